"""``pilotrun ledger``: the runs and their gate rows, from the SQLite ledger."""
from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.table import Table
from rich.text import Text

from ..config.ids import NAME_MAX
from ..ledger.records import GateRow
from ..ledger.store import Ledger, LedgerError
from ..ledger.tables import TABLES, selected_runs, table, write_csv
from ..ui.console import STYLE, gate_table
from ..ui.tables import Column, Footnotes, fit_noted, print_table
from .common import (
    UsageError,
    add_ledger_arg,
    command_parser,
    err_console,
    existing_ledger,
    id_arg,
    out_console,
)

HELP = """examples:
  pilotrun ledger                      # recent runs, newest first
  pilotrun ledger --name tiny-sft      # runs of one job
  pilotrun ledger --run tiny-sft-2026  # one run's gate rows (a prefix: the newest run it matches)
  pilotrun ledger --run ID --full      # reasons whole, wrapped, not cut to the terminal's width
  pilotrun ledger --run ID --json      # for scripts
  pilotrun ledger --csv > runs.csv     # every run, one row each (status, stop reason, final val loss, verdicts)
  pilotrun ledger --csv metrics --run lr-sweep-2026 --out sweep-metrics.csv   # per-update metrics of a campaign
  pilotrun ledger --mlflow sqlite:///mlflow.db --run lr-sweep-2026            # optional: pip install mlflow"""


def add_parser(sub) -> None:
    p = command_parser(sub, "ledger", __doc__, HELP)
    add_ledger_arg(p)
    p.add_argument("--run", help="show one run's gate rows (an id, or a prefix: the newest run it matches; the "
                   "others are listed)")
    p.add_argument("--full", action="store_true", help="with --run: print every reason whole, wrapped")
    p.add_argument("--name", type=id_arg(NAME_MAX), help="only runs with this spec name")
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--csv", nargs="?", const="runs", choices=TABLES, metavar="TABLE",
                   help=f"export a table as CSV ({', '.join(TABLES)}; default runs), for --run/--name or every run")
    p.add_argument("--out", type=Path, help="with --csv: write this file instead of standard output")
    p.add_argument("--mlflow", metavar="URI", help="export the selected runs to MLflow (e.g. sqlite:///mlflow.db); "
                   "diverged and failed runs get status FAILED")
    p.set_defaults(func=main)


def main(args) -> int:
    path = existing_ledger(args)
    console = out_console()
    if args.csv or args.mlflow:
        return _export(args, path, console)
    with Ledger(path) as led:
        if args.run:
            run, others = _pick(led, args.run, path)
            rows = led.gate_rows(run["run_id"])
            if args.json:
                run["lock"] = json.loads(run.pop("lock_json") or "null")
                run["meta"] = json.loads(run.pop("meta_json") or "{}")
                print(json.dumps({"run": run, "gates": rows, "metrics": led.metrics(run["run_id"]),
                                  "notes": led.notes(run["run_id"]), "other_matches": others}, indent=1, default=str))
                return 0
            console.print(Text.assemble(("run ", "bold"), run["run_id"], f" · {run['name']} · "
                                        f"{status_text(run, led.children(run['run_id']))} · "
                                        f"started {run['started_at']}"))
            if run["kind"] == "campaign":  # a campaign has runs, not gates
                runs = led.campaign_runs(run["run_id"])
                summaries = {r["run_id"]: led.gate_records(r["run_id"]) for r in runs}
                print_table(console, *run_table(runs, summaries, {}, console.width))
            elif run["kind"] == "campaign-run":
                console.print(_result(run, []), highlight=False)
            else:
                console.print(gate_table([GateRow.from_mapping(r) for r in rows], width=console.width,
                                         full=args.full))
            return 0
        runs = led.runs(args.name, args.limit)
        summaries = {r["run_id"]: led.gate_records(r["run_id"]) for r in runs}
        children = {r["run_id"]: led.children(r["run_id"]) for r in runs}
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k not in ("lock_json", "meta_json")} |
                          {"verdicts": {g.gate: str(g.verdict) for g in summaries[r["run_id"]]}} for r in runs],
                         indent=1, default=str))
        return 0
    if runs:
        print_table(console, *run_table(runs, summaries, children, console.width))
    else:
        console.print("no runs yet")
    return 0


def _pick(led: Ledger, ref: str, path: Path) -> tuple[dict, list[str]]:
    """The run ``ref`` names: its exact id, or the newest run it is a prefix of; the other matches are listed
    on stderr (as git lists an ambiguous ref, but showing the likeliest one rather than refusing)."""
    found = led.matches(ref)
    if not found:
        raise UsageError(f"no run {ref!r} in {path}; see `pilotrun ledger`")
    others = [r["run_id"] for r in found[1:]]
    if others:
        shown = others[:10]
        more = f" (and {len(others) - len(shown)} more: `pilotrun ledger --name ...`)" if len(others) > 10 else ""
        err_console().print(f"{ref!r} matches {len(found)} runs; showing the newest, {found[0]['run_id']}. The others, "
                            f"newest first{more}:\n" + "\n".join(f"  {o}" for o in shown)
                            + "\ngive more of the id to pick one", highlight=False, markup=False)
    return found[0], others


def status_text(run: dict, children: list[str]) -> str:
    """A run's status as people should read it: which signal interrupted it, and a run killed without
    recording its end (SIGKILL, power loss) that a later ``--resume`` continued."""
    status = run["status"]
    meta = json.loads(run.get("meta_json") or "{}")
    if status == "interrupted" and meta.get("interrupted_by"):
        status = f"interrupted ({meta['interrupted_by']})"
    if status == "running" and not run["ended_at"]:
        status = "killed (no end recorded)" if children else "running (no end recorded)"
    if children and run["kind"] == "pilot":
        status += f"; continued by {', '.join(children)}"
    return status


def _result(r: dict, gate_rows: Sequence[GateRow]) -> str:
    """What a run came to: gate verdicts for a pilot; variant, seed, stop or final loss for a campaign run."""
    if r["kind"] == "campaign-run":  # its rows are per-update points, not gates with verdicts
        from ..campaign.conclude import stop_text
        from ..ledger.records import final_val_loss

        meta = json.loads(r.get("meta_json") or "{}")
        final = final_val_loss(r["status"], meta)
        what = stop_text(meta) or (f"final val loss {final:.4g}" if final is not None else "")
        return (f"{meta.get('key')}={json.dumps(meta.get('variant'))} seed {meta.get('seed')}"
                + (f" · {what}" if what else ""))
    if r["kind"] == "campaign":
        return "see `pilotrun ledger --run " + r["run_id"] + "`"
    counts: dict[str, int] = {}
    for g in gate_rows:
        counts[str(g.verdict)] = counts.get(str(g.verdict), 0) + 1
    return " · ".join(f"{n} {v}" for v, n in sorted(counts.items()))


# Left out first on a narrow console: when a run started, its kind, its name (the id, whole, says it); the id and
# status stay.
_RUN_COLUMNS = (Column("run", whole=True), Column("name", "left", 1), Column("kind", "left", 2), Column("status"),
                Column("started", "left", 3), Column("gates / result"))


def run_table(runs: list[dict], summaries: Mapping[str, Sequence[GateRow]], children: dict[str, list[str]],
              width: int) -> tuple[Table, list[str], Footnotes]:
    """One line per run within ``width``; a long status (who continued it) or result is a numbered footnote."""
    def rows(notes: Footnotes) -> list[list]:
        return [[r["run_id"], r["name"], r["kind"],
                 Text(notes.cell(status_text(r, children.get(r["run_id"], []))), style=STYLE.get(r["status"], "")),
                 r["started_at"][:16].replace("T", " "), notes.cell(_result(r, summaries[r["run_id"]]))] for r in runs]

    return fit_noted(_RUN_COLUMNS, rows, width)


def _export(args, path: Path, console) -> int:
    with Ledger(path) as led:
        try:
            runs = selected_runs(led, args.run, args.name)
        except LedgerError as exc:
            raise UsageError(str(exc)) from None
        if args.run and not runs:
            raise UsageError(f"no run {args.run!r} in {path} ; see `pilotrun ledger`")
        if args.mlflow:
            from ..ledger.mlflow_export import MlflowUnavailable, export_runs

            try:
                done = export_runs(led, runs, args.mlflow)
            except MlflowUnavailable as exc:
                raise UsageError(str(exc)) from None
            console.print(f"exported {len(done)} run(s) to {args.mlflow} "
                          f"(experiment {done[0]['experiment'] if done else '-'})"
                          + "".join(f"\n  {d['run_id']} -> {d['mlflow_run_id']} {d['status']}" for d in done),
                          highlight=False, markup=False)
            if not args.csv:
                return 0
        columns, rows = table(led, args.csv, args.run, args.name)
    if args.out:
        with open(args.out, "w", newline="") as fh:
            n = write_csv(fh, columns, rows)
        console.print(f"wrote {n} {args.csv} row(s) to {args.out}", highlight=False, markup=False)
    else:
        write_csv(sys.stdout, columns, rows)
    return 0
