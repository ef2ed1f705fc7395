"""The ledger as flat tables (runs, gates, metrics, notes) for CSV, spreadsheets and pandas.

Pure reads: nothing here writes to the ledger. Nested values (sample ids, extra metrics,
memory, inputs) are kept as JSON text in one column, so a row is never silently truncated.

Example::

    with Ledger("runs/ledger.sqlite") as led:
        write_csv(sys.stdout, *table(led, "metrics", run="lr-sweep-2026"))
"""
from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from typing import IO

from .records import RunKind, RunStatus, final_val_loss
from .store import Ledger

TABLES = ("runs", "gates", "metrics", "notes")

RUN_COLUMNS = ["run_id", "name", "kind", "status", "started_at", "ended_at", "parent_id", "config_hash", "spec_path",
               "out_dir", "campaign_id", "variant", "seed", "control", "stop_reason", "stopped_at", "final_val_loss",
               "final_accuracy", "lock_drift", "verdicts"]
GATE_COLUMNS = ["run_id", "gate", "verdict", "reason", "seconds", "rank", "world_size", "started_at", "ended_at",
                "inputs", "memory", "details"]
METRIC_COLUMNS = ["run_id", "gate", "rank", "step", "loss", "lr", "grad_norm", "examples", "tokens", "seconds",
                  "data_wait_s", "extra", "sample_ids"]
NOTE_COLUMNS = ["run_id", "at", "text"]


def _j(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def selected_runs(led: Ledger, run: str | None = None, name: str | None = None, limit: int | None = None) -> list[dict]:
    """One run, a campaign with its runs (retries included), or every run (of one name)."""
    if run:
        row = led.run(run)
        if row is None:
            return []
        out = [row]
        if row["kind"] == RunKind.CAMPAIGN:
            out += [{k: v for k, v in r.items() if k != "meta"} for r in led.campaign_runs(row["run_id"])]
        return out
    rows = led.runs(name, limit or 1_000_000)
    return list(reversed(rows))  # oldest first reads like a lab notebook


def run_rows(led: Ledger, runs: Iterable[dict]) -> list[dict]:
    out = []
    for r in runs:
        meta = json.loads(r.get("meta_json") or "{}")
        final = meta.get("final") or {}
        verdicts: dict[str, int] = {}
        for g in led.gate_rows(r["run_id"]):
            verdicts[g["verdict"]] = verdicts.get(g["verdict"], 0) + 1
        out.append({
            **{k: r.get(k) for k in ("run_id", "name", "kind", "status", "started_at", "ended_at", "parent_id",
                                     "config_hash", "spec_path", "out_dir")},
            "campaign_id": meta.get("campaign_id"), "variant": _j(meta["variant"]) if "variant" in meta else None,
            "seed": meta.get("seed"), "control": meta.get("control"), "stop_reason": meta.get("stop_reason"),
            # Only a finished run has a final value; a stopped one's last point is in metrics.csv.
            "stopped_at": meta.get("stopped_at"),
            "final_val_loss": final_val_loss(r["status"], meta),
            "final_accuracy": final.get("accuracy") if r.get("status") == RunStatus.FINISHED else None,
            "lock_drift": ";".join(meta.get("lock_drift") or []) or None,
            "verdicts": " ".join(f"{v}={n}" for v, n in sorted(verdicts.items())) or None,
        })
    return out


def table(led: Ledger, which: str, run: str | None = None, name: str | None = None) -> tuple[list[str], list[dict]]:
    """``(columns, rows)`` of one table, restricted to a run, a campaign (and its runs) or a spec name."""
    if which not in TABLES:
        raise ValueError(f"unknown table {which!r}: one of {', '.join(TABLES)}")
    runs = selected_runs(led, run, name)
    if which == "runs":
        return RUN_COLUMNS, run_rows(led, runs)
    rows: list[dict] = []
    for r in runs:
        if which == "gates":
            for g in led.gate_rows(r["run_id"]):
                rows.append({c: (_j(g[c]) if c in ("inputs", "memory", "details") else g.get(c)) for c in GATE_COLUMNS})
        elif which == "metrics":
            for m in led.metrics(r["run_id"]):
                rows.append({c: (_j(m[c]) if c in ("extra", "sample_ids") else m.get(c)) for c in METRIC_COLUMNS})
        else:
            rows += [{c: n.get(c) for c in NOTE_COLUMNS} for n in led.notes(r["run_id"])]
    return {"gates": GATE_COLUMNS, "metrics": METRIC_COLUMNS, "notes": NOTE_COLUMNS}[which], rows


def write_csv(fh: IO[str], columns: list[str], rows: list[dict]) -> int:
    w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return len(rows)
