"""``pilotrun launch``: run a pilot on several processes with torchrun, one per device.

Equivalent to ``torchrun --standalone --nproc-per-node N -m pilotrun run SPEC``, with the checks
torchrun does not do: the process count against the visible devices, a strategy in the spec,
one run id for every rank, and an exit code taken from the combined report.

Several machines: run the same command on each with ``--nnodes N --node-rank R --rdzv-endpoint
HOST:PORT`` (torchrun's c10d rendezvous, hosted by node 0). The nodes meet under a rendezvous id
derived from what their commands share (:func:`rendezvous_id`); rank 0 then creates the run id and
the process group gives it to every rank, which also checks that every node runs the same config.
Each node's ranks write their rows to that node's ledger (the run is added to it when it is
another machine's file); rank 0's node holds the combined report.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.markup import escape

from .. import strategies
from ..config.load import load_spec
from ..devices import query_devices
from ..distributed import RUN_ID_FILE_VAR
from ..interrupt import Interrupted, interruptible
from ..ledger.records import RunStatus, new_run_id
from ..ledger.store import Ledger
from ..lock import DIGEST_FORMAT, resolve_container_digest
from ..procs import with_torchrun_folder
from .common import (
    EXIT_BAD_INPUT,
    EXIT_GATE_FAILED,
    EXIT_INTERNAL,
    UsageError,
    add_ledger_arg,
    command_parser,
    id_arg,
    out_console,
)

HELP = """examples:
  pilotrun launch --nproc-per-node 2 examples/tiny-sft/pilot.yaml --set distributed.strategy=ddp
  pilotrun launch --nproc-per-node 2 pilot.yaml --set distributed.strategy=fsdp --gates load,first_step,save,restore
  pilotrun launch --nnodes 2 --node-rank 0 --rdzv-endpoint head:29500 --nproc-per-node 8 pilot.yaml
  pilotrun launch --nproc-per-node 4 pilot.yaml --task-id "$SKYPILOT_TASK_ID" --proven-lock lock.json   # a task's

On GPUs --nproc-per-node defaults to the visible devices and may not exceed them (LOCAL_RANK picks the
device); on CPU give it explicitly (gloo). Every rank writes its own rows; report.json combines them."""


def add_parser(sub) -> None:
    p = command_parser(sub, "launch", __doc__, HELP)
    p.add_argument("--nproc-per-node", type=int, help="processes on this machine (default: visible GPUs)")
    p.add_argument("--nnodes", type=int, default=1, help="machines in the run, each running this same command")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's number, 0 .. nnodes-1, for messages (torchrun's c10d rendezvous gives the ranks "
                        "by arrival: global rank 0 may be on any node)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (several nodes): node 0's address and a free "
                                           "port; the node whose address it is hosts it")
    p.add_argument("spec")
    p.add_argument("--out", type=Path)
    add_ledger_arg(p)
    p.add_argument("--gates")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--container-digest", help=f"image digest of the container, {DIGEST_FORMAT}")
    p.add_argument("--run-id", type=id_arg(),
                   help="the run's id; on several nodes give every node the same one or none (default: rank 0 creates "
                        "it and every node takes it)")
    p.add_argument("--task-id", metavar="ID", type=id_arg(),
                   help="the task running this command, the same across its restarts ($SKYPILOT_TASK_ID): a passed "
                        "pilot of this task is not launched again (exit 0), a failed one stops it again (exit 1), "
                        "one cut short is launched again (a distributed pilot is not resumed)")
    p.add_argument("--proven-lock", type=Path, metavar="LOCK_JSON",
                   help="a lock.json every rank's lock gate compares this environment with")
    p.add_argument("--rdzv-id", help="torchrun's rendezvous id (several nodes; default: the --run-id, else derived "
                                     "from the spec's name, the endpoint and --nnodes, the same on every node)")
    p.set_defaults(func=main)


def plan_processes(requested: int | None, nnodes: int) -> tuple[int, str]:
    """How many processes per node, and why; an error that says what to change when they cannot run."""
    inv = query_devices()
    if inv.runtime.indexed:  # one process per device
        if requested is None:
            return inv.count, f"{inv.count} visible {inv.backend} device(s)"
        if requested > inv.count:
            raise UsageError(f"--nproc-per-node {requested} but only {inv.count} {inv.backend} device(s) are visible "
                             "(one process per device; check CUDA_VISIBLE_DEVICES)")
        return requested, f"{requested} of {inv.count} visible {inv.backend} device(s)"
    if requested is None:
        raise UsageError("no accelerator is visible: give --nproc-per-node for CPU processes (gloo)")
    if requested < 1:
        raise UsageError("--nproc-per-node must be at least 1")
    return requested, f"{requested} CPU process(es) on gloo"


def rendezvous_id(name: str, endpoint: str, nnodes: int, run_id: str | None) -> str:
    """The id torchrun's rendezvous groups the nodes by: the same on every node started with the same command.

    Every node must pass the same one or they never meet, so it cannot be random or from a clock: it is the
    given run id, else a digest of what the nodes' commands share (job name, endpoint, node count). Two launches
    on one endpoint one after the other are still apart: the rendezvous lives with the agent that hosts it and
    ends with it; the run id (not this) is what tells the runs apart in the ledger."""
    if run_id:
        return run_id
    digest = hashlib.sha256(f"{name}|{endpoint}|{nnodes}".encode()).hexdigest()[:12]
    return f"pilotrun-{name}-{digest}"


def _agreed(id_file: str) -> tuple[str | None, int | None]:
    """What this node's first process wrote (distributed.agree_run_id): the run id and its global rank."""
    lines = Path(id_file).read_text().split()
    return (lines[0] if lines else None), (int(lines[1]) if len(lines) > 1 and lines[1].isdigit() else None)


def find_report(out: Path | None, rank: int | None = None) -> Path | None:
    """The report this node's exit code comes from: the combined one on rank 0's node; elsewhere this node's first
    rank's own, which carries the status over every rank (the ranks gather each other's rows) and is complete once
    this node's processes ended -- rank 0's, in a folder the nodes share, may still be being written."""
    if out is None:
        return None
    own = out / ("report.json" if rank in (0, None) else f"report-rank{rank}.json")
    if own.exists():
        return own
    ranks = sorted(out.glob("report-rank*.json"))
    return ranks[0] if ranks else None


def _task_done(args, spec) -> int | None:
    """``--task-id``, decided once here for every rank: the exit code when the task's pilot is not launched again."""
    from ..pilot.recovery import Recovery
    from .run import task_recovery

    plan = task_recovery(args.task_id, args.ledger, spec, out_console())
    if plan.action == Recovery.PROVEN:
        return 0
    if plan.action == Recovery.FAILED:
        return EXIT_GATE_FAILED
    if plan.action == Recovery.RESUME:
        out_console().print("pilot: a distributed pilot is continued by launching it again: a new run", highlight=False)
    return None


def _torchrun_command(args, name: str, nproc: int, run_id: str | None) -> tuple[list[str], Path | None]:
    """torchrun running ``pilotrun run`` on each rank, and the run's folder when this node knows it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if args.nnodes == 1:
        cmd.append("--standalone")
    else:
        rdzv = args.rdzv_id or rendezvous_id(name, args.rdzv_endpoint, args.nnodes, args.run_id)
        # No --node-rank for torchrun: its c10d rendezvous ignores it (ranks go by arrival) and says so per node.
        cmd += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}",
                f"--rdzv-id={rdzv}"]
    cmd += ["-m", "pilotrun", "run", str(args.spec)]
    out = args.out or (Path("runs") / run_id if run_id else None)  # None: rank 0 names it (several nodes)
    for flag, value in (("--run-id", run_id), ("--out", out),
                        ("--ledger", args.ledger), ("--gates", args.gates),
                        ("--container-digest", args.container_digest), ("--task-id", args.task_id),
                        ("--proven-lock", args.proven_lock)):
        if value:
            cmd += [flag, str(value)]
    for item in args.overrides:
        cmd += ["--set", item]
    return cmd, out


def main(args) -> int:
    spec = load_spec(args.spec, args.overrides)
    resolve_container_digest(args.container_digest)  # refused here once, not once per rank
    nproc, why = plan_processes(args.nproc_per_node, args.nnodes)
    world = nproc * args.nnodes
    if world > 1 and not strategies.get(spec.distributed.strategy).multi_process:
        several = strategies.multi_process_names()
        raise UsageError(f"{world} processes need distributed.strategy {' or '.join(several)} in the spec "
                         f"(or --set distributed.strategy={several[0]})")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--nnodes {args.nnodes} --node-rank {args.node_rank}: --nnodes is at least 1 and "
                         "--node-rank is 0 .. nnodes-1")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the address of node 0, a free port)")
    if args.rdzv_endpoint and not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", args.rdzv_endpoint):
        raise UsageError(f"--rdzv-endpoint {args.rdzv_endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29500)")
    if args.task_id is not None and (done := _task_done(args, spec)) is not None:
        return done
    # Create the ledger before the ranks start: a broken one is one clear error here, not one per rank.
    Ledger(args.ledger).close()
    # One node: this launcher names the run. Several: each node's launcher alone cannot (see rendezvous_id), so
    # rank 0 creates the id and the process group carries it to every rank (distributed.agree_run_id).
    run_id = args.run_id or (new_run_id(spec.name) if args.nnodes == 1 else None)
    cmd, out = _torchrun_command(args, spec.name, nproc, run_id)
    console = out_console()
    named = f"run {run_id}" if run_id else "run id: created by rank 0 and shared by every node"
    where = f"; node {args.node_rank} of {args.nnodes}" if args.nnodes > 1 else ""
    console.print(f"[bold]launch[/] "
                  f"{escape(f'{world} process(es){where}: {why}; strategy {spec.distributed.strategy}; {named}')}")
    fd, id_file = tempfile.mkstemp(prefix="pilotrun-run-id-")
    os.close(fd)
    try:
        env = {**os.environ, "PILOTRUN_LAUNCHED": "1", RUN_ID_FILE_VAR: id_file}
        # Several nodes without --out: the run's folder is named by rank 0 later; runs/ holds torchrun's meanwhile.
        env = with_torchrun_folder(env, (Path(out) if out is not None else Path("runs")).resolve() / "torchrun")
        proc = subprocess.Popen(cmd, env=env)
        try:
            with interruptible():
                code = proc.wait()
        except Interrupted as stop:
            # Ctrl-C reached every process of the terminal's group already; SIGTERM/SIGHUP came to the launcher
            # alone (preemption, a scheduler): pass it on so each rank records the run as interrupted.
            if stop.signum != signal.SIGINT:
                proc.send_signal(stop.signum)
            proc.wait()
            agreed = _agreed(id_file)[0] or run_id or "(not started: no run id agreed yet)"
            console.print(f"[bold yellow]interrupted ({stop.how})[/]: run {escape(agreed)} recorded as interrupted; "
                          "a distributed pilot is continued by launching it again", highlight=False)
            return stop.exit_code
        agreed, first_rank = _agreed(id_file)
        agreed = agreed or run_id
    finally:
        Path(id_file).unlink(missing_ok=True)
    report = find_report(args.out or (Path("runs") / agreed if agreed else None), first_rank)
    if report is None:
        when = "" if agreed else ", before the ranks agreed on a run id (each rank's error is above)"
        console.print(f"[bold red]the processes ended (code {code}) without a report{escape(when)}[/]")
        return EXIT_INTERNAL if code else EXIT_BAD_INPUT
    if args.nnodes > 1:
        console.print(f"[bold]launch[/] node {args.node_rank}: run {escape(str(agreed))}, report {escape(str(report))}",
                      highlight=False)
    status = json.loads(report.read_text()).get("status")
    if code and status != RunStatus.FAIL:
        return EXIT_INTERNAL
    return EXIT_GATE_FAILED if status == RunStatus.FAIL else 0
