"""``pilotrun campaign CAMPAIGN.yaml``: the control and its variants over seeds, every run kept."""
from __future__ import annotations

import json
from pathlib import Path

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..campaign.conclude import link_text, stop_text, table, unanswered_failures
from ..campaign.engines.base import ENGINES, EngineChoice
from ..campaign.engines.nodes import Leader, NodeError, NodeGroup, NodeLost, follow
from ..campaign.followup import recover, resume, retry
from ..campaign.orchestrate import CampaignError, CampaignInterrupted, run_campaign
from ..interrupt import Interrupted, interruptible
from ..ledger.records import final_val_loss
from ..ledger.store import default_ledger_path
from ..lock import resolve_container_digest
from .common import (
    EXIT_GATE_FAILED,
    EXIT_INTERNAL,
    EXIT_OK,
    UsageError,
    add_ledger_arg,
    command_parser,
    err_console,
    id_arg,
    out_console,
)

HELP = """examples:
  pilotrun campaign examples/campaign/lr-sweep.yaml
  pilotrun campaign examples/campaign/lr-sweep.yaml --parallel 2
  pilotrun campaign lr-sweep-2026 --retry r05 --set train.micro_batch_size=4 --set train.grad_accum_steps=4
  pilotrun campaign lr-sweep-2026 --resume --parallel 2   # after Ctrl-C: run what was stopped or not run
  pilotrun campaign lr-sweep.yaml --task-id "$SKYPILOT_TASK_ID"   # start, or continue after a preemption
  pilotrun report lr-sweep-2026                  # the HTML report
  pilotrun campaign examples/campaign/lr-sweep.yaml --engine ray                  # a local Ray instance
  pilotrun campaign lr-sweep.yaml --engine ray --address 10.0.0.5:6379 --storage /shared/runs   # a Ray cluster
  pilotrun campaign sweep.yaml --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29500 --nproc-per-node 8
                                                 # and --node-rank 1 on the other node: every run over both

A retry is a new run linked to its parent (never a replacement) and may change only what keeps the
experiment the same: micro batch with accumulation (examples per update held), activation checkpointing.
A resume runs each run the interrupt cut short again from the start, as a new run linked to it, within
the budget the campaign had left; runs with a result (finished, diverged, failed) are left as they are.
`gpus_per_run: N` in the campaign file makes each run of pilotrun's loop a torchrun group of N ranks (a program's
run takes as many devices as its launcher starts, or gpus_per_run where its command does not say); locally each
run gets its own N devices, runs side by side never share one. With --engine ray each run is a Ray task (a CPU per
process, and a GPU per process unless the spec trains on the CPU, torchrun inside it); only this process
writes the ledger; a run whose Ray worker or node was lost is kept as stopped at its last recorded update and
--resume runs it again as a new linked run.
With --nnodes N every run spans N nodes, one run at a time: node 0 runs the campaign and writes the ledger, the
other nodes follow it (a store at the endpoint's next port), take a run only when their own campaign file gives the
same spec, start their ranks under torchrun's static rendezvous and hand their rows to node 0; every node ends with
node 0's exit code (docs/guides/distributed.md).
With --task-id ID (a task a scheduler restarts; SkyPilot's $SKYPILOT_TASK_ID stays the same across its recoveries)
the command is safe to run again: the first start starts the campaign and keeps the id on its row; a restart finds
that campaign in the ledger and continues it as --resume does (its process, recorded on a node the restart replaced,
is taken as gone); a campaign that has ended is left as it is.
Exit 0 when every run has a result (finished, diverged or stopped by a rule) or its recorded reason (refused, not
run); 1 when a run failed (raised, or ended without a result) and no later attempt of its variant and seed finished
or diverged; 2 bad file or usage; 3 internal error; 130/143/129 interrupted (every run recorded)."""


def add_parser(sub) -> None:
    p = command_parser(sub, "campaign", __doc__, HELP)
    p.add_argument("campaign", help="CAMPAIGN.yaml, or a campaign id with --retry or --resume")
    p.add_argument("--parallel", type=int, default=None,
                   help="runs at once, at most (default: 1 locally; with --engine ray, what the cluster fits); "
                        "locally with several GPUs each run gets its own (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES; "
                        "N of them for a run of N processes: gpus_per_run, or a program's launcher); "
                        "fewer when the cores, the GPUs or the memory a pilot of the base spec measured do not "
                        "allow it (the reason is printed and kept)")
    p.add_argument("--engine", choices=ENGINES, default="local",
                   help="local: worker processes on this machine; ray: one Ray task per run (pip install -e "
                        "'.[ray]'), on a local Ray instance or the cluster at --address")
    p.add_argument("--address", help="with --engine ray: an existing Ray cluster (HOST:PORT of its head, or 'auto')")
    p.add_argument("--storage", type=Path,
                   help="with --engine ray: the folder for the runs' checkpoints, exports and predictions "
                        "(on a cluster, a shared filesystem mounted at the same path on every node; default: the "
                        "campaign's folder under --out)")
    add_ledger_arg(p)
    p.add_argument("--out", type=Path, default=Path("runs"), help="parent folder of the campaign's folder")
    p.add_argument("--allow-drift", action="store_true",
                   help="run despite a lock that drifted; such runs are flagged and kept out of comparisons")
    p.add_argument("--retry", metavar="RUN", help="retry this run of the campaign as a new, linked run")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted campaign: its stopped and not-run runs, as new linked runs")
    p.add_argument("--task-id", metavar="ID", type=id_arg(),
                   help="the id of the task running this command, the same across its restarts ($SKYPILOT_TASK_ID): "
                        "start the campaign, or continue the one this task started (see below)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    nodes = p.add_argument_group("every run over several nodes (the same command on each node; see below)")
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes every run spans (default 1: this machine)")
    nodes.add_argument("--node-rank", type=int, default=0,
                       help="this node, 0 .. nnodes-1: node 0 runs the campaign and writes the ledger, the others "
                            "follow it")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="node 0's address and a free port (torchrun's rendezvous; the next port is the "
                            "campaign's own)")
    nodes.add_argument("--nproc-per-node", type=int, help="processes of each run on each node (its accelerators)")
    p.set_defaults(func=main)


def node_group(args) -> NodeGroup | None:
    """The cluster every run spans (``--nnodes`` above 1), checked; None on one machine."""
    given = args.node_rank or args.rdzv_endpoint is not None or args.nproc_per_node is not None
    if args.nnodes == 1:
        if given:
            raise UsageError("--node-rank, --rdzv-endpoint and --nproc-per-node go with --nnodes N (above 1)")
        return None
    if not args.rdzv_endpoint or not args.nproc_per_node:
        raise UsageError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address, a free port) "
                         "and --nproc-per-node N (each node's processes)")
    if args.engine != "local" or args.retry or args.resume:
        raise UsageError("--nnodes runs the campaign file on the local engine of every node: leave out --engine ray, "
                         "--retry and --resume (with --task-id a restart continues it)")
    try:
        return NodeGroup(args.nnodes, args.node_rank, args.nproc_per_node, args.rdzv_endpoint)
    except NodeError as exc:
        raise UsageError(str(exc)) from None


def main(args) -> int:
    group = node_group(args)
    if group is None:
        return _campaign(args, None)
    if group.node_rank > 0:
        return _follow(args, group)
    try:
        leader = Leader(group)
    except NodeError as exc:
        raise UsageError(str(exc)) from None
    code = EXIT_INTERNAL
    try:
        with interruptible():  # a signal while planning, too: the other nodes are told how this one ended
            code = _campaign(args, leader)
        if leader.lost:
            err_console().print(f"[bold red]node lost[/]: {escape('; '.join(leader.lost))}: the runs after it are "
                                "recorded as not run, and a restart of the task (--task-id) runs them",
                                highlight=False)
            code = max(code, EXIT_GATE_FAILED)
        return code
    except BaseException as exc:
        from . import exit_code_for

        code = exit_code_for(exc)
        raise
    finally:
        leader.end(code)


def _follow(args, group: NodeGroup) -> int:
    """Node R (above 0): follow node 0's campaign until it ends; its exit code."""
    if not Path(args.campaign).is_file():
        raise UsageError(f"{args.campaign!r} is not a campaign file: every node runs the same campaign file")
    err_console().print(f"campaign: node {group.node_rank} of {group.nnodes} follows node 0 at "
                        f"{escape(group.endpoint)}", highlight=False)
    try:
        with interruptible():
            return follow(group, Path(args.campaign), args.out)
    except (NodeError, CampaignError) as exc:
        raise UsageError(str(exc)) from None
    except NodeLost as exc:
        err_console().print(f"[bold red]node 0 lost[/]: {escape(str(exc))}", highlight=False)
        return EXIT_GATE_FAILED
    except Interrupted as exc:
        return exc.exit_code


def _campaign(args, leader: Leader | None) -> int:
    ledger = args.ledger or default_ledger_path()
    console = out_console()
    resolve_container_digest()  # every run's lock reads $PILOTRUN_CONTAINER_DIGEST: refuse a malformed one up front
    try:
        if args.retry and args.resume:
            raise UsageError("--retry reruns one run differently, --resume continues an interrupted campaign: "
                             "give one of them")
        if args.task_id is not None and (args.retry or args.resume):
            raise UsageError("--task-id starts or continues a campaign file by itself: leave out --retry and --resume")
        if args.task_id is not None and not args.task_id.strip():
            raise UsageError("--task-id is empty: give the id that stays the same across the task's restarts "
                             "(SkyPilot sets $SKYPILOT_TASK_ID; outside SkyPilot, any name of your own)")
        if args.engine != "ray" and (args.address or args.storage):
            raise UsageError("--address and --storage go with --engine ray")
        engine = EngineChoice(args.engine, args.address, args.storage, nodes=leader)
        if args.retry:
            result = retry(args.campaign, args.retry, args.overrides, ledger, engine)
        else:
            if args.parallel is not None and args.parallel < 1:
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
                if not args.json and (at_once["requested"] > 1 or at_once.get("engine")):  # one at a time: no need
                    console.print(f"campaign {campaign_id}: {at_once['text']}", highlight=False, markup=False)
                    for line in at_once["checked"] + at_once["not_checked"]:
                        console.print(f"  {line}", style="dim", highlight=False, markup=False)

            if args.task_id is not None:
                _, what, result = recover(Path(args.campaign), args.task_id, Path(ledger), args.out, args.parallel,
                                          args.allow_drift, event, start, engine)
                if not args.json:
                    console.print(f"campaign: {what}", highlight=False, markup=False)
            elif args.resume:
                result = resume(args.campaign, ledger, args.parallel, args.allow_drift, event, start, engine)
            else:
                result = run_campaign(Path(args.campaign), ledger, args.out, args.parallel, args.allow_drift, event,
                                      start, engine)
    except CampaignError as exc:
        raise UsageError(str(exc)) from None
    except CampaignInterrupted as exc:
        _show(args, exc.result)
        err_console().print(f"[yellow]interrupted ({exc.how})[/]: every run is recorded (stopped where it was, or "
                            f"not run); `pilotrun report {exc.result['campaign_id']}` shows them, `pilotrun campaign "
                            f"{exc.result['campaign_id']} --resume` runs again what was cut short")
        return exc.exit_code
    _show(args, result)
    return _exit_code(result)


def _exit_code(result: dict) -> int:
    """1 while a run's failure has no answer (campaign.conclude.unanswered_failures), as `pilotrun run` exits 1 when a
    gate failed; the runs are named on stderr."""
    failed = unanswered_failures(result["runs"])
    if not failed:
        return EXIT_OK
    named = "; ".join(f"{r['run_id']} ({stop_text(r['meta']) or 'no reason recorded'})" for r in failed[:5])
    more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
    err_console().print(f"[bold red]{len(failed)} run(s) failed[/]: {escape(named)}{more}. `pilotrun campaign "
                        f"{escape(result['campaign_id'])} --retry RUN` runs one again as a new linked run",
                        highlight=False)
    return EXIT_GATE_FAILED


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
