"""``pilotrun launch``: run a pilot on several processes with torchrun, one per device.

Equivalent to ``torchrun --standalone --nproc-per-node N -m pilotrun run SPEC``, with the checks
torchrun does not do: the process count against the visible devices, a strategy in the spec,
one run id for every rank, and an exit code taken from the combined report.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from rich.markup import escape

from .. import strategies
from ..config.spec import load_spec
from ..devices import query_devices
from ..interrupt import Interrupted, interruptible
from ..ledger.records import RunStatus, new_run_id
from ..ledger.store import Ledger
from ..lock import DIGEST_FORMAT, resolve_container_digest
from .common import EXIT_BAD_INPUT, EXIT_GATE_FAILED, EXIT_INTERNAL, UsageError, add_ledger_arg, out_console

HELP = """examples:
  pilotrun launch --nproc-per-node 2 examples/tiny-sft/pilot.yaml --set distributed.strategy=ddp
  pilotrun launch --nproc-per-node 2 pilot.yaml --set distributed.strategy=fsdp --gates load,first_step,save,restore
  pilotrun launch --nnodes 2 --node-rank 0 --rdzv-endpoint head:29500 --nproc-per-node 8 pilot.yaml

On GPUs --nproc-per-node defaults to the visible devices and may not exceed them (LOCAL_RANK picks the
device); on CPU give it explicitly (gloo). Every rank writes its own rows; report.json combines them."""


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("launch", help="run the pilot on several processes (torchrun)", description=__doc__,
                       epilog=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", type=int, help="processes on this machine (default: visible GPUs)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (several nodes)")
    p.add_argument("spec")
    p.add_argument("--out", type=Path)
    add_ledger_arg(p)
    p.add_argument("--gates")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--container-digest", help=f"image digest of the container, {DIGEST_FORMAT}")
    p.add_argument("--run-id", help="shared by every node of a multi-node launch (default: generated)")
    p.set_defaults(func=main)


def plan_processes(requested: int | None, nnodes: int) -> tuple[int, str]:
    """How many processes per node, and why; an error that says what to change when they cannot run."""
    inv = query_devices()
    if inv.backend in ("cuda", "rocm"):
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


def main(args) -> int:
    spec = load_spec(args.spec, args.overrides)
    resolve_container_digest(args.container_digest)  # refused here once, not once per rank
    nproc, why = plan_processes(args.nproc_per_node, args.nnodes)
    world = nproc * args.nnodes
    if world > 1 and not strategies.get(spec.distributed.strategy).multi_process:
        several = strategies.multi_process_names()
        raise UsageError(f"{world} processes need distributed.strategy {' or '.join(several)} in the spec "
                         f"(or --set distributed.strategy={several[0]})")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")
    # Create the ledger before the ranks start: a broken one is one clear error here, not one per rank.
    Ledger(args.ledger).close()
    run_id = args.run_id or new_run_id(spec.name)
    out = args.out or Path("runs") / run_id
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if args.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-id={run_id}"]
    cmd += ["-m", "pilotrun", "run", str(args.spec), "--run-id", run_id, "--out", str(out)]
    for flag, value in (("--ledger", args.ledger), ("--gates", args.gates),
                        ("--container-digest", args.container_digest)):
        if value:
            cmd += [flag, str(value)]
    for item in args.overrides:
        cmd += ["--set", item]
    console = out_console()
    console.print(f"[bold]launch[/] "
                  f"{escape(f'{world} process(es): {why}; strategy {spec.distributed.strategy}; run {run_id}')}")
    env = {**os.environ, "PILOTRUN_LAUNCHED": "1"}
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
        console.print(f"[bold yellow]interrupted ({stop.how})[/]: run {escape(run_id)} recorded as interrupted; a "
                      "distributed pilot is continued by launching it again", highlight=False)
        return stop.exit_code
    report = Path(out) / "report.json"
    if not report.exists():
        console.print(f"[bold red]the processes ended (code {code}) without a report[/]")
        return EXIT_INTERNAL if code else EXIT_BAD_INPUT
    status = json.loads(report.read_text()).get("status")
    if code and status != RunStatus.FAIL:
        return EXIT_INTERNAL
    return EXIT_GATE_FAILED if status == RunStatus.FAIL else 0
