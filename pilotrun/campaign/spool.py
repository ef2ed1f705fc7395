"""A campaign run's rows as JSON lines, for the ranks of a run that is a process group inside a Ray task.

The ranks do not talk to Ray and never write the ledger: each appends its rows (per-update points,
validations, the run's end) to its own file in the run's folder; the Ray task that started them reads
the new complete lines and sends them to the driver, which alone writes the ledger.

Example::

    with SpoolSink(out / "spool" / "rank1.jsonl") as sink:
        sink.add_metrics(run_id, Series.TRAIN, points, rank=1)
    items = SpoolReader(out / "spool").new_items()   # [("metrics", run_id, "train", points, 1)]
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..ledger.records import RunEnd, RunStatus, Series, StopKind


def end_item(run_id: str, end: RunEnd, fields: dict) -> tuple:
    """A run's end as plain data (what crosses a process or a Ray boundary)."""
    return ("end", run_id, (str(end.status), end.stop and str(end.stop), end.reason, end.at), fields)


def write_item(led, item: tuple | list) -> bool:
    """One spooled row (``metrics`` or ``end``) into the ledger ``led``; False for a kind this module does not write
    (an engine's own, such as Ray's ``start``). Only the process that owns the ledger calls it."""
    kind, run_id, *rest = item
    if kind == "metrics":
        led.add_metrics(run_id, Series(rest[0]), rest[1], rank=rest[2])
    elif kind == "end":
        (status, stop, reason, at), fields = rest
        led.finish_campaign_run(run_id, RunEnd(RunStatus(status), stop and StopKind(stop), reason, at), **fields)
    else:
        return False
    return True


class SpoolSink:
    """One rank's rows, appended as JSON lines (runner.RunSink)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 — closed by __exit__

    def __enter__(self) -> SpoolSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def _write(self, item: tuple) -> None:
        self.file.write(json.dumps(item, default=str) + "\n")
        self.file.flush()  # a line is written whole before the reader may see it; a killed rank keeps what it sent

    def add_metrics(self, run_id: str, series: Series, points: list[dict], rank: int = 0) -> None:
        self._write(("metrics", run_id, str(series), list(points), rank))

    def finish_campaign_run(self, run_id: str, end: RunEnd, **fields: Any) -> None:
        self._write(end_item(run_id, end, fields))


class SpoolReader:
    """The complete lines every rank appended since the last call (a partly written last line waits)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.offsets: dict[Path, int] = {}

    def new_items(self) -> list[tuple]:
        items = []
        for path in sorted(self.folder.glob("rank*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            complete = data[:data.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            items += [tuple(json.loads(line)) for line in complete.decode().splitlines() if line]
        return items
