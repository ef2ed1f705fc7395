"""``report.json``: a pilot's rows as one file, per rank and combined over ranks."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.spec import Spec
from ..ledger.records import ROW_FIELDS, GateRow, RunStatus, Verdict
from ..safefile import write_atomic


@dataclass
class PilotResult:
    run_id: str
    out_dir: Path
    ledger_path: Path
    rows: list[dict] = field(default_factory=list)   # this rank's rows
    status: RunStatus = RunStatus.RUNNING
    rank: int = 0
    world_size: int = 1
    all_rows: list[dict] = field(default_factory=list)  # every rank's rows (rank 0, distributed runs)
    interrupted_by: str | None = None  # the signal that stopped it ("SIGTERM"), when status is interrupted
    ledger_failure: Any = None  # the LedgerWriteFailed that stopped it (a full disk): its end is in FALLBACK_FILE

    @property
    def records(self) -> list[GateRow]:
        """This rank's rows, typed (``rows`` is their JSON form, as report.json and the ledger keep it)."""
        return [GateRow.from_mapping(r) for r in self.rows]

    @property
    def all_records(self) -> list[GateRow]:
        """Every rank's rows, typed (rank 0 of a distributed pilot; ``all_rows`` is their JSON form)."""
        return [GateRow.from_mapping(r) for r in self.all_rows]

    @property
    def failed(self) -> bool:
        return any(r.verdict == Verdict.FAIL for r in (self.all_records or self.records))

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


# Where a pilot whose ledger refused a write (a full disk) records its end and rows instead.
FALLBACK_FILE = "ledger-fallback.json"


def write_report(result: PilotResult, spec: Spec, extra: dict | None = None) -> Path:
    """``report.json``; with several ranks every rank writes ``report-rank{r}.json`` and rank 0 also the
    combined ``report.json`` with every rank's rows and a per-gate summary over ranks."""
    if result.world_size > 1:
        _write_json(result, spec, result.rows, result.out_dir / f"report-rank{result.rank}.json", extra)
        if result.rank != 0 or not result.all_rows:
            return result.out_dir / f"report-rank{result.rank}.json"
        extra = {**(extra or {}), "world_size": result.world_size,
                 "ranks_summary": [s.to_json() for s in rank_summary(result.all_records)]}
        return _write_json(result, spec, result.all_rows, result.out_dir / "report.json", extra)
    return _write_json(result, spec, result.rows, result.out_dir / "report.json", extra)


def _write_json(result: PilotResult, spec: Spec, rows: list[dict], path: Path, extra: dict | None) -> Path:
    report = {
        "run_id": result.run_id,
        "name": spec.name,
        "spec": spec.source,
        "config_hash": spec.config_hash(),
        "out_dir": str(result.out_dir),
        "ledger": str(result.ledger_path),
        "status": str(result.status),
        **({"interrupted_by": result.interrupted_by} if result.interrupted_by else {}),
        "gates": [{k: r.get(k) for k in ROW_FIELDS} for r in rows],
        **(extra or {}),
    }
    write_atomic(path, json.dumps(report, indent=1, default=str))  # whole or not at all; WriteFailed names why
    return path


@dataclass(frozen=True)
class RankSummary:
    """One gate over the ranks of a distributed pilot: the worst verdict, the largest peak and time, and any
    imbalance worth a look (``report.json``'s ``ranks_summary`` entries are its JSON form)."""

    gate: str
    verdict: Verdict
    ranks: int
    max_peak_allocated_bytes: int | None
    max_seconds: float | None
    imbalance: tuple[str, ...]
    worst_rank: int

    def to_json(self) -> dict:
        return {"gate": self.gate, "verdict": str(self.verdict), "ranks": self.ranks,
                "max_peak_allocated_bytes": self.max_peak_allocated_bytes, "max_seconds": self.max_seconds,
                "imbalance": list(self.imbalance), "worst_rank": self.worst_rank}


def rank_summary(rows: Sequence[GateRow]) -> list[RankSummary]:
    """Per gate over ranks: the worst verdict, the largest peak and time, and any imbalance worth a look."""
    by_gate: dict[str, list[GateRow]] = {}
    for r in rows:
        by_gate.setdefault(r.gate, []).append(r)
    out = []
    for gate, rs in by_gate.items():
        peaks: list[int] = [p for r in rs if (p := r.memory.get("peak_allocated_bytes"))]
        secs: list[float] = [r.seconds for r in rs if r.seconds]
        flags = []
        # Relative and absolute: a few KiB of bookkeeping on one rank is not an imbalance.
        if len(peaks) > 1 and min(peaks) and max(peaks) / min(peaks) > 1.10 and max(peaks) - min(peaks) > 16 * 2**20:
            flags.append(f"memory differs across ranks by {max(peaks) / min(peaks) - 1:.0%}")
        if len(secs) > 1 and min(secs) > 0.05 and max(secs) / min(secs) > 1.25:
            flags.append(f"time differs across ranks by {max(secs) / min(secs) - 1:.0%}")
        worst = min(rs, key=lambda r: r.verdict.severity)
        out.append(RankSummary(gate, worst.verdict, len(rs), max(peaks) if peaks else None,
                               max(secs) if secs else None, tuple(flags), worst.rank))
    return out
