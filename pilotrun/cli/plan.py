"""``pilotrun plan SPEC``: the whole pipeline's time and what a 3, 7 or 30-day rental buys."""
from __future__ import annotations

import json
from pathlib import Path

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..estimate.experiments import adapter_line
from ..estimate.plan import Assumptions, more_gpus_advice, pipeline_hours, rental_plans
from ..estimate.source import model_download
from ..humanize import money
from ..ui.tables import Column, Footnotes, fit_noted, print_table
from .common import UsageError, add_ledger_arg, command_parser, err_console, ledger_if_present, out_console
from .estimate import add_trace_cache_arg, load_estimated, print_program_job, print_trace_notes
from .select import add_inter_node_arg, batch_notes, build_sheet, gpus_cell, inter_node_notes
from .skypilot_task import SKYPILOT_HELP, add_skypilot_args, check_args, write_task

HELP = """examples:
  pilotrun plan examples/llama-7b-estimate/pilot.yaml --accelerator H100-80GB
  pilotrun plan pilot.yaml --runs 6 --accelerator a100 --json
  pilotrun plan pilot.yaml --runs 3 --egress-mb-s 50 --evals 20
  pilotrun plan examples/llama-70b-estimate/pilot.yaml --accelerator H100-80GB --inter-node-gb-s 50   # 2 nodes
  pilotrun plan pilot.yaml --accelerator H100-80GB --spot --skypilot task.yaml --bucket my-runs --campaign sweep.yaml

Items measured by a pilot of this spec (preprocessing, data wait, evaluation, checkpoint speed) come from the
ledger; the rest are assumptions printed with their value. 7 days suit compatibility and profiling; 30 days
are only advised when a measured pilot on that accelerator backs the time estimate. The model download follows
model: none for model.config, the files of a local model.hf, a Hub revision's files when it is in the local
Hugging Face cache, else not measured (--model-gb). Costs need price_per_gpu_hour in a --catalog file.
--spot: the node may be preempted: each run's pipeline gets the expected recovery (--preemptions-per-day, each
--relaunch-minutes plus half a run's training redone, as a cut-short campaign run restarts) and costs use
spot_price_per_gpu_hour (the on-demand price, said so, when the catalog has none).

""" + SKYPILOT_HELP


def add_parser(sub) -> None:
    p = command_parser(sub, "plan", __doc__, HELP)
    p.add_argument("spec")
    p.add_argument("--runs", type=int, default=1, help="runs of the whole pipeline (a campaign's size)")
    p.add_argument("--accelerator", action="append", default=[])
    p.add_argument("--catalog", type=Path)
    add_ledger_arg(p)
    add_inter_node_arg(p)
    p.add_argument("--download-mb-s", type=float, default=Assumptions.download_mb_s)
    p.add_argument("--egress-mb-s", type=float, default=Assumptions.egress_mb_s)
    p.add_argument("--evals", type=int, default=Assumptions.evals_per_run, help="evaluations per run")
    p.add_argument("--checkpoints", type=int, default=Assumptions.checkpoints_per_run, help="checkpoints per run")
    p.add_argument("--data-gb", type=float, default=0.0, help="dataset to download, GB")
    p.add_argument("--model-gb", type=float,
                   help="model files to download, GB (default: from the model source: none for model.config, the "
                        "local files' size, the Hub revision's size when it is in the local cache)")
    p.add_argument("--spot", action="store_true",
                   help="preemptible (spot) capacity: the expected recovery is added to each run, costs at the spot "
                        "price; the --skypilot task gets use_spot")
    p.add_argument("--preemptions-per-day", type=float, default=Assumptions.preemptions_per_day,
                   help="with --spot: expected preemptions per day of node time (assumed)")
    p.add_argument("--relaunch-minutes", type=float, default=Assumptions.relaunch_minutes,
                   help="with --spot: minutes to relaunch and set up a node after a preemption (assumed)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    add_trace_cache_arg(p)
    p.add_argument("--json", action="store_true")
    add_skypilot_args(p, spot_flag=False)
    p.set_defaults(func=main)


def main(args) -> int:
    if args.runs < 1:
        raise UsageError("--runs must be at least 1")
    for flag, value in (("--download-mb-s", args.download_mb_s), ("--egress-mb-s", args.egress_mb_s)):
        if value <= 0:
            raise UsageError(f"{flag} must be a positive rate, got {value}")
    for flag, value in (("--evals", args.evals), ("--checkpoints", args.checkpoints), ("--data-gb", args.data_gb),
                        ("--model-gb", args.model_gb or 0), ("--preemptions-per-day", args.preemptions_per_day),
                        ("--relaunch-minutes", args.relaunch_minutes)):
        if value < 0:
            raise UsageError(f"{flag} must be 0 or more, got {value}")
    check_args(args)
    spec, job = load_estimated(args, quiet=args.json)
    rows, traces = build_sheet(spec, args, None, args.json)
    ledger = ledger_if_present(args.ledger)
    a = Assumptions(download_mb_s=args.download_mb_s, egress_mb_s=args.egress_mb_s, evals_per_run=args.evals,
                    checkpoints_per_run=args.checkpoints, data_bytes=int(args.data_gb * 1e9),
                    preemptions_per_day=args.preemptions_per_day, relaunch_minutes=args.relaunch_minutes)
    download = model_download(spec, args.model_gb)
    out: list[dict] = []
    for row in rows:
        if not row["fits"]:
            out.append({"accelerator": row["accelerator"], "configuration": row, "per_run": None, "plans": [],
                        "more_gpus": None, "verdict": "does not fit with any configuration tried: no rental plan"})
            continue
        trace = traces.get(ac=row["activation_checkpointing"])
        per_run = pipeline_hours(spec, row, trace, ledger, a, download, spot=args.spot)
        out.append({"accelerator": row["accelerator"], "configuration": row, "per_run": per_run,
                    "plans": rental_plans(row, per_run, args.runs), "more_gpus": more_gpus_advice(row, per_run)})
    wrote = (write_task(spec, args, out[0]["configuration"], traces, out[0]["per_run"], args.runs, a)
             if args.skypilot is not None else None)
    if args.json:
        print(json.dumps({"spec": spec.source, "runs": args.runs, "assumptions": a.to_dict(), "accelerators": out,
                          "trace_cache": traces.notes, "skypilot": str(args.skypilot) if wrote else None,
                          "program": job.to_dict() if job is not None else None},
                         indent=1, default=str))
        if wrote:
            err_console().print(escape(wrote), highlight=False)
        return 0
    print_trace_notes(traces)
    console = out_console()
    if job is not None:
        print_program_job(console, job)
    for item in out:
        _print_item(console, item, args.runs)
    if wrote:
        console.print(Text(wrote, style="bold"))
    return 0


_PER_RUN_COLUMNS = (Column("item"), Column("hours", "right"), Column("cost", "right", 1), Column("from"))


def per_run_table(per_run: dict, runs: int, width: int) -> tuple[Table, list[str], Footnotes]:
    """One run's items, one line each within ``width``: each "from" (an assumption and its flag) in its cell where
    the table fits whole, else a long one cut, whole in a numbered footnote."""
    def rows(notes: Footnotes) -> list[list]:
        out: list[list] = [[i["item"], f"{i['hours']:.2f}" if i["hours"] is not None else "?", money(i["cost"]),
                            notes.cell(i["from"])] for i in per_run["items"]]
        runs_cost = per_run["cost"] * runs if per_run["cost"] is not None else None
        return out + [[Text("one run", style="bold"), Text(f"{per_run['hours']:.1f}", style="bold"),
                       Text(money(per_run["cost"]), style="bold"),
                       notes.cell(f"x {runs} run(s) = {per_run['hours'] * runs:.1f} h, {money(runs_cost)}")]]

    return fit_noted(_PER_RUN_COLUMNS, rows, width, limits=(40,))  # words over costs (often "—") at 80


def _print_item(console, item: dict, runs: int) -> None:
    """One accelerator's plan: its configuration, the per-run items, the rental plans."""
    row, per_run = item["configuration"], item["per_run"]
    if per_run is None:
        console.print(Text.assemble((item["accelerator"], "bold cyan"), " · ", (item["verdict"], "red")))
        console.print(Text("  " + "; ".join(row["steps"]), style="dim"))
        console.print()
        return
    console.print(Text.assemble((item["accelerator"], "bold cyan"),
                                f" · {row['strategy']} x{gpus_cell(row)}"
                                f"{' + AC' if row['activation_checkpointing'] else ''}"
                                f" · micro batch {row['micro_batch_size']} x {row['grad_accum_steps']}"
                                f" · {'fits' if row['fits'] else 'DOES NOT FIT'}"))
    if row.get("adapter"):
        console.print(Text("  " + adapter_line(row["adapter"]), style="dim"))
    for note in inter_node_notes([row]) + batch_notes([row]):
        console.print(Text("  " + note, style="dim"))
    table, dropped, notes = per_run_table(per_run, runs, console.width)
    print_table(console, table, dropped, notes)
    if per_run["cost_note"]:
        console.print(Text("  " + per_run["cost_note"], style="dim"))
    for p in item["plans"]:
        verdict = Text("fits", style="green") if p["fits_with_margin"] else Text("too short", style="red")
        cost = (f", rental {money(p['cost'])} (the runs themselves: {money(p['work_cost'])})" if p.get("cost")
                else "")
        on = f"{p['gpus']} GPU(s)" + (f" on {row['nodes']} nodes" if (row.get("nodes") or 1) > 1 else "")
        console.print(Text.assemble(f"  {p['days']:>2} days on {on}{cost}: ", verdict,
                                    f" ({p['runs_that_fit']} run(s) fit with a 20% margin)"
                                    + (f"; {'; '.join(p['advice'])}" if p["advice"] else "")))
    console.print(Text(f"  more GPUs? {item['more_gpus']}", style="dim"))
    console.print()
