"""One campaign run in its own process.

    python -m pilotrun.campaign.worker --spec SPEC.json --run-id ID --out DIR --ledger L.sqlite --plan PLAN.json

A campaign with ``gpus_per_run`` above 1 starts it under torchrun (:func:`group_command`): each rank writes its
own update points, rank 0 the validations and the run's end. On the local engine the ranks write the ledger as
parallel workers do; inside a Ray task ``--spool DIR`` replaces ``--ledger``: each rank appends its rows to
DIR/rank<R>.jsonl and the task sends them to the driver.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from ..workers.common import read_spec_file
from . import kinds
from .run_plan import CampaignRunPlan
from .spool import SpoolSink
from .stops import STOP_REASON_FILE, STOP_SIGNAL


def group_command(ranks: int, worker_args: list[str]) -> list[str]:
    """The worker as ``ranks`` processes under torchrun: a fresh ``--standalone`` group on this machine (its own
    rendezvous on a free port, so runs side by side never meet), one rank per device the run was given (LOCAL_RANK
    picks it among the visible ones; gloo on CPU). The engines start this for a campaign of ``gpus_per_run`` above 1."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "pilotrun.campaign.worker", *worker_args]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pilotrun.campaign.worker")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--out", type=Path, required=True)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--ledger", type=Path)
    where.add_argument("--spool", type=Path, help="a folder for this rank's rows (spool.py), instead of the ledger")
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--deadline", type=float)
    args = ap.parse_args(argv)
    stop = threading.Event()

    def on_sigint(signum, frame) -> None:
        if stop.is_set():  # the second Ctrl-C: now, not at the next update
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGINT, on_sigint)
    # The campaign's own stop request: only ever sets the flag, so that arriving on top of a terminal's
    # Ctrl-C (which reached this process too) it does not count as a second, "stop now" Ctrl-C.
    signal.signal(STOP_SIGNAL, lambda signum, frame: stop.set())
    if hasattr(signal, "SIGHUP"):  # the terminal or SSH session went away: stop where we are, recorded
        signal.signal(signal.SIGHUP, lambda signum, frame: stop.set())
    def how() -> str:
        # The campaign writes what stopped it before signalling; a terminal's Ctrl-C may arrive first.
        try:
            return (args.plan.parent / STOP_REASON_FILE).read_text().strip() or "Ctrl-C"
        except OSError:
            return "Ctrl-C"

    sink = SpoolSink(args.spool / f"rank{os.environ.get('RANK', '0')}.jsonl") if args.spool else None
    spec = read_spec_file(args.spec)
    run = kinds.of(spec).run()  # a program's run only supervises it: no torch imported here
    result = run(spec, args.run_id, args.out, args.ledger, CampaignRunPlan.from_json(json.loads(args.plan.read_text())),
                 args.deadline,
                 stop.is_set, how, sink=sink)
    if stop.is_set():
        return 130
    return 0 if result["status"] in ("finished", "diverged", "stopped") else 1


if __name__ == "__main__":
    from ..procs import quiet_import_noise

    quiet_import_noise()  # torchao's import warnings (through transformers') are not this job's
    sys.exit(main())
