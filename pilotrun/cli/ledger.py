"""``pilotrun ledger``: the runs and their gate rows, from the SQLite ledger."""
from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table
from rich.text import Text

from ..ledger.store import Ledger, LedgerError, default_ledger_path
from ..ui.console import STYLE, gate_table
from .common import UsageError, out_console

HELP = """examples:
  pilotrun ledger                      # recent runs, newest first
  pilotrun ledger --name tiny-sft      # runs of one job
  pilotrun ledger --run tiny-sft-2026  # one run's gate rows (a unique prefix is enough)
  pilotrun ledger --run ID --json      # for scripts"""


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("ledger", help="list runs and gate rows", description=__doc__, epilog=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ledger", type=Path, help="ledger file (default runs/ledger.sqlite, or $PILOTRUN_LEDGER)")
    p.add_argument("--run", help="show one run's gate rows (id or unique prefix)")
    p.add_argument("--name", help="only runs with this spec name")
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=main)


def main(args) -> int:
    path = args.ledger or default_ledger_path()
    if not Path(path).exists():
        raise UsageError(f"no ledger at {path}: run a pilot first, or pass --ledger")
    console = out_console()
    with Ledger(path) as led:
        if args.run:
            try:
                run = led.run(args.run)
            except LedgerError as exc:
                raise UsageError(str(exc)) from None
            if run is None:
                raise UsageError(f"no run {args.run!r} in {path} ; see `pilotrun ledger`")
            rows = led.gate_rows(run["run_id"])
            if args.json:
                run["lock"] = json.loads(run.pop("lock_json") or "null")
                run["meta"] = json.loads(run.pop("meta_json") or "{}")
                print(json.dumps({"run": run, "gates": rows, "metrics": led.metrics(run["run_id"]),
                                  "notes": led.notes(run["run_id"])}, indent=1, default=str))
                return 0
            console.print(Text.assemble(("run ", "bold"), run["run_id"], f" · {run['name']} · {run['status']} · "
                                        f"started {run['started_at']}"))
            console.print(gate_table(rows, width=console.width))
            return 0
        runs = led.runs(args.name, args.limit)
        summaries = {r["run_id"]: led.gate_rows(r["run_id"]) for r in runs}
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k not in ("lock_json", "meta_json")} |
                          {"verdicts": {g["gate"]: g["verdict"] for g in summaries[r["run_id"]]}} for r in runs],
                         indent=1, default=str))
        return 0
    table = Table(box=None, header_style="bold")
    id_w = max([len(r["run_id"]) for r in runs] + [3])
    table.add_column("run", no_wrap=True, min_width=id_w)
    for col in ("name", "kind", "status", "started", "gates"):
        table.add_column(col, no_wrap=True)
    for r in runs:
        status = r["status"]
        shown = status if status != "running" or r["ended_at"] else "running (no end recorded)"
        counts = {}
        for g in summaries[r["run_id"]]:
            counts[g["verdict"]] = counts.get(g["verdict"], 0) + 1
        table.add_row(r["run_id"], r["name"], r["kind"], Text(shown, style=STYLE.get(status, "")), r["started_at"][:16].replace("T", " "),
                      " · ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    console.print(table if runs else "no runs yet")
    return 0
