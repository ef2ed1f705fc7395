"""``pilotrun campaign CAMPAIGN.yaml``: the control and its variants over seeds, every run kept."""
from __future__ import annotations

import json
from pathlib import Path

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..campaign.conclude import link_text, stop_text, table
from ..campaign.followup import resume, retry
from ..campaign.orchestrate import CampaignError, CampaignInterrupted, run_campaign
from ..ledger.records import final_val_loss
from ..ledger.store import default_ledger_path
from ..lock import resolve_container_digest
from .common import UsageError, add_ledger_arg, err_console, out_console

HELP = """examples:
  pilotrun campaign examples/campaign/lr-sweep.yaml
  pilotrun campaign examples/campaign/lr-sweep.yaml --parallel 2
  pilotrun campaign lr-sweep-2026 --retry r05 --set train.micro_batch_size=4 --set train.grad_accum_steps=4
  pilotrun campaign lr-sweep-2026 --resume --parallel 2   # after Ctrl-C: run what was stopped or not run
  pilotrun report lr-sweep-2026                  # the HTML report

A retry is a new run linked to its parent (never a replacement) and may change only what keeps the
experiment the same: micro batch with accumulation (examples per update held), activation checkpointing.
A resume runs each run the interrupt cut short again from the start, as a new run linked to it, within
the budget the campaign had left; runs with a result (finished, diverged, failed) are left as they are."""


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("campaign", help="run a control and variants over seeds", description=__doc__, epilog=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("campaign", help="CAMPAIGN.yaml, or a campaign id with --retry or --resume")
    p.add_argument("--parallel", type=int, default=1,
                   help="runs at once on this machine, at most; with several GPUs each run gets its own "
                        "(CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES); fewer when the devices, the cores or the "
                        "memory a pilot of the base spec measured do not allow it (the limit is printed and kept)")
    add_ledger_arg(p)
    p.add_argument("--out", type=Path, default=Path("runs"), help="parent folder of the campaign's folder")
    p.add_argument("--allow-drift", action="store_true",
                   help="run despite a lock that drifted; such runs are flagged and kept out of comparisons")
    p.add_argument("--retry", metavar="RUN", help="retry this run of the campaign as a new, linked run")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted campaign: its stopped and not-run runs, as new linked runs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(args) -> int:
    ledger = args.ledger or default_ledger_path()
    console = out_console()
    resolve_container_digest()  # every run's lock reads $PILOTRUN_CONTAINER_DIGEST: refuse a malformed one up front
    try:
        if args.retry and args.resume:
            raise UsageError("--retry reruns one run differently, --resume continues an interrupted campaign: "
                             "give one of them")
        if args.retry:
            result = retry(args.campaign, args.retry, args.overrides, ledger)
        else:
            if args.parallel < 1:
                raise UsageError("--parallel must be at least 1")
            if args.overrides:
                raise UsageError("--set goes with --retry; to change the campaign, edit its file")
            if not args.resume and not Path(args.campaign).is_file() and not args.campaign.endswith((".yaml", ".yml")):
                raise UsageError(f"{args.campaign!r} is not a campaign file; to continue an interrupted campaign "
                                 f"give --resume, to rerun one run --retry RUN")

            def event(run: dict) -> None:
                if not args.json:
                    why = stop_text(json.loads(run.get("meta_json") or "{}"))
                    console.print(f"  {run['status']:<9} {run['run_id']}" + (f"  ({why})" if why else ""),
                                  highlight=False, markup=False)

            def start(campaign_id: str, at_once: dict) -> None:
                for line in [] if args.json else at_once["warnings"]:
                    err_console().print(f"[yellow]warning[/]: {escape(line)}", highlight=False)
                if not args.json and at_once["requested"] > 1:  # one at a time needs no explaining
                    console.print(f"campaign {campaign_id}: {at_once['text']}", highlight=False, markup=False)
                    for line in at_once["checked"] + at_once["not_checked"]:
                        console.print(f"  {line}", style="dim", highlight=False, markup=False)

            if args.resume:
                result = resume(args.campaign, ledger, args.parallel, args.allow_drift, event, start)
            else:
                result = run_campaign(Path(args.campaign), ledger, args.out, args.parallel, args.allow_drift, event,
                                      start)
    except CampaignError as exc:
        raise UsageError(str(exc)) from None
    except CampaignInterrupted as exc:
        _show(args, exc.result)
        err_console().print(f"[yellow]interrupted ({exc.how})[/]: every run is recorded (stopped where it was, or "
                            f"not run); `pilotrun report {exc.result['campaign_id']}` shows them, `pilotrun campaign "
                            f"{exc.result['campaign_id']} --resume` runs again what was cut short")
        return exc.exit_code
    _show(args, result)
    return 0


def _show(args, result: dict) -> None:
    console = out_console()
    if args.json:
        print(json.dumps({"campaign_id": result["campaign_id"], "parallel": result.get("parallel"),
                          "conclusion": result["conclusion"],
                          "runs": [{k: r[k] for k in ("run_id", "status", "parent_id")} | {"meta": r["meta"]}
                                   for r in result["runs"]]}, indent=1, default=str))
        return
    c = result["conclusion"]
    t = Table(box=None, header_style="bold", title=f"campaign {result['campaign_id']}", title_justify="left")
    for col in ("run", c["key"], "seed", "status", "stopped", "final val loss", "follows"):
        t.add_column(col)
    for r in result["runs"]:
        m = r["meta"]
        status_style = {"finished": "green", "diverged": "red", "failed": "red"}.get(r["status"], "yellow")
        final = final_val_loss(r["status"], m)
        t.add_row(r["run_id"], Text(str(m.get("variant"))), str(m.get("seed")), Text(r["status"], style=status_style),
                  Text(stop_text(m)),
                  f"{final:.4g}" if final is not None else "", Text(link_text(m)))
    console.print(t)
    s = Table(box=None, header_style="bold", title=f"per variant ({c['metric']})", title_justify="left")
    for col in (c["key"], "mean ± spread", "accuracy", "finished", "diverged", "beats control"):
        s.add_column(col)
    for row in table(c):
        s.add_row(*(Text(cell) if isinstance(cell, str) else cell for cell in row))
    console.print(s)
    for line in c["text"]:
        console.print(Text("• " + line, style="bold"))
