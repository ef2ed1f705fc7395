"""``pilotrun run SPEC``: run the gates, show them live, write the ledger and report.json."""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from .. import strategies
from ..config.load import load_spec
from ..config.schema import SpecError
from ..devices import DeviceUnavailable
from ..distributed import LaunchError, env_from_os
from ..drivers import driver_class
from ..gates import UnknownGate
from ..interrupt import interruptible
from ..ledger.records import Failure, Verdict
from ..ledger.store import LedgerError
from ..lock import DIGEST_FORMAT, resolve_container_digest
from ..pilot import PilotInterrupted, PilotOptions, ResumeError, rank_summary, run_pilot
from ..strategies import UnknownStrategy
from ..ui.console import ConsoleObserver
from .common import (
    EXIT_GATE_FAILED,
    EXIT_OK,
    UsageError,
    add_ledger_arg,
    command_parser,
    console_for,
    id_arg,
    out_console,
    writable_folder,
)

HELP = """examples:
  pilotrun run examples/tiny-sft/pilot.yaml
  pilotrun run pilot.yaml --gates eval            # eval and what it needs (load)
  pilotrun run pilot.yaml --set train.micro_batch_size=2 --set train.grad_accum_steps=8
  pilotrun run pilot.yaml --json > report.json    # the report on stdout, the live table on stderr
  pilotrun run pilot.yaml --resume                # continue the last interrupted pilot of this spec
  pilotrun run pilot.yaml --task-id "$SKYPILOT_TASK_ID" --proven-lock lock.json   # a SkyPilot task's pilot

your own program (README, "Pilot your own program"): a spec with
  name: own-loop
  program:
    command: torchrun --standalone --nproc-per-node 2 train.py
and in train.py `job = pilotrun.program()` (job.update, job.should_save, job.saved, job.should_stop,
job.resume_from, job.stage); then `pilotrun run pilot.yaml` runs it as control, interrupted (SIGKILL after its
save) and resumed, and compares the updates: examples/own-loop/

--task-id ID (a task a scheduler restarts: SkyPilot's $SKYPILOT_TASK_ID, the same across its recoveries): the
task's pilot that passed is not run again (exit 0), one that failed a gate stops the task again (exit 1), one cut
short is continued with --resume (or run again when it left no checkpoint to resume), and a task with no pilot yet
runs it. --proven-lock FILE: the lock gate compares this machine's environment with that lock.json (the pilot that
proved the job elsewhere) and names what drifted; a torch built for another device is said as such, not as drift.

exit codes: 0 no gate failed, 1 a gate failed, 2 bad spec/file/usage,
  130 stopped by Ctrl-C, 143 by SIGTERM (preemption, timeout), 129 by SIGHUP: recorded as interrupted;
  `pilotrun run SPEC --resume` continues it"""


def add_parser(sub) -> None:
    p = command_parser(sub, "run", __doc__, HELP)
    p.add_argument("spec", help="path to pilot.yaml")
    p.add_argument("--out", type=Path, help="output folder (default runs/<run id>)")
    add_ledger_arg(p)
    p.add_argument("--gates", help="comma-separated gates to run (prerequisites are added)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec key, e.g. train.micro_batch_size=4 (repeatable)")
    p.add_argument("--container-digest", help=f"image digest of the container this runs in, {DIGEST_FORMAT} "
                                              "(recorded in the lock; or set $PILOTRUN_CONTAINER_DIGEST)")
    p.add_argument("--resume", nargs="?", const="latest", metavar="RUN",
                   help="continue an interrupted pilot from its last good checkpoint (the latest interrupted run of "
                        "this spec, or RUN); gates it already passed are carried over")
    p.add_argument("--trust", action="store_true",
                   help="load a checkpoint whose manifest the ledger did not record: every file is still checked "
                        "against its manifest, .pt files load with weights_only=True, and a DCP checkpoint (its "
                        "metadata is a pickle) stays refused")
    p.add_argument("--task-id", metavar="ID", type=id_arg(),
                   help="the id of the task running this command, the same across its restarts ($SKYPILOT_TASK_ID): "
                        "a passed pilot of this task is not run again, one cut short is resumed")
    p.add_argument("--proven-lock", type=Path, metavar="LOCK_JSON",
                   help="a lock.json the lock gate compares this environment with (instead of the last run of this "
                        "name), e.g. the laptop pilot's, carried to a rented node")
    p.add_argument("--json", action="store_true", help="print report.json to stdout (the table goes to stderr)")
    p.add_argument("--run-id", type=id_arg(), help=argparse.SUPPRESS)  # set by `pilotrun launch`: one id for every rank
    p.set_defaults(func=main)


def main(args) -> int:
    if args.json:
        # stdout carries only the report: anything user code prints goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            code, report = _run(args)
        print(report)
        return code
    return _run(args)[0]


def _run(args) -> tuple[int, str | None]:
    spec = load_spec(args.spec, args.overrides, allow_program=True)
    resolve_container_digest(args.container_digest)  # a malformed digest is exit 2 before anything runs
    gates = [g.strip() for g in args.gates.split(",") if g.strip()] if args.gates else None
    options = PilotOptions(out_dir=args.out, ledger_path=args.ledger, gates=gates,
                           container_digest=args.container_digest, resume=args.resume, trust=args.trust,
                           run_id=args.run_id, proven_lock=_proven_lock(args.proven_lock), task_id=args.task_id)
    console = console_for(stderr=True) if args.json else out_console()
    # Under `pilotrun launch` the launcher decided for every rank (task_recovery); --task-id is then the run's mark.
    launched = bool(os.environ.get("PILOTRUN_LAUNCHED"))
    recovered = _recover(args, spec, options, console) if args.task_id is not None and not launched else None
    if recovered is not None:
        return recovered, None
    writable_folder(args.out or Path("runs"), "--out" if args.out else "the output folder runs/ (or pass --out)")
    if env_from_os()[0] != 0:  # under torchrun only rank 0 speaks; every rank writes its rows
        console = Console(file=open(os.devnull, "w"))
    observer = ConsoleObserver(console, title=spec.name)
    try:
        with interruptible():
            try:
                result = run_pilot(spec, options, observer)
            except ResumeError as exc:
                if args.task_id is None or not options.resume:
                    raise
                # A task's pilot cut short before it saved anything has nothing to resume: it runs again, said so.
                console.print(f"[yellow]{escape(str(exc))}[/]: running the pilot again as a new run", highlight=False)
                options.resume = None
                result = run_pilot(spec, options, observer)
    except PilotInterrupted as stop:
        if observer.live is not None:
            observer.live.stop()
            observer.live = None
        _stopped(stop, spec, args, console)
        return stop.exit_code, (stop.result.out_dir / "report.json").read_text() if args.json else None
    except UnknownGate as exc:
        raise UsageError(f"--gates: {exc}") from None
    except UnknownStrategy as exc:
        raise SpecError([("distributed.strategy", str(exc))], spec.source) from None
    except DeviceUnavailable as exc:
        raise SpecError([("train.device", str(exc))], spec.source) from None
    except (LedgerError, ResumeError, LaunchError) as exc:
        raise UsageError(str(exc)) from None
    finally:
        if observer.live is not None:
            observer.live.stop()
    observer.finish(result.status, result.out_dir, result.ledger_path,
                    rank_summary(result.all_records) if result.all_rows else None)
    _advise_after_oom(spec, result, console)
    report = (result.out_dir / "report.json").read_text() if args.json else None
    # Under `pilotrun launch` the launcher reads the status from report.json: a failed gate is not a crashed
    # worker, and torchrun would report it as one.
    code = 0 if os.environ.get("PILOTRUN_LAUNCHED") and result.world_size > 1 else result.exit_code
    return code, report


def _proven_lock(path: Path | None) -> tuple[str, dict] | None:
    """``--proven-lock``: (its path, the lock) or None; exit 2 naming the file when it is not a pilotrun lock.json."""
    if path is None:
        return None
    from ..safefile import FileProblem, read_json

    try:
        lock = read_json(path, 64 << 20, schema={"versions": dict, "distributions": dict})
    except FileProblem as exc:
        raise UsageError(f"--proven-lock: {exc}; give a run's lock.json (runs/RUN/lock.json, or the one `pilotrun "
                         "plan --skypilot` writes beside the task)") from None
    return f"the proven lock {path}", lock


def task_recovery(task_id: str, ledger: Path | None, spec, console):
    """What the task ``task_id`` does with this spec's pilot now (``pilot.recovery``), said on ``console``; exit 2
    for an empty id."""
    from ..ledger.records import RunKind
    from ..ledger.store import Ledger, default_ledger_path
    from ..pilot.recovery import Recovery, RecoveryPlan, pilot_recovery

    if not task_id.strip():
        raise UsageError("--task-id is empty: give the id that stays the same across the task's restarts "
                         "(SkyPilot sets $SKYPILOT_TASK_ID; outside SkyPilot, any name of your own)")
    path = Path(ledger or default_ledger_path())
    if not path.exists():
        plan = RecoveryPlan(Recovery.START, None, f"task {task_id}: no ledger at {path} yet")
    else:
        with Ledger(path) as led:
            plan = pilot_recovery(led.task_runs(spec.name, RunKind.PILOT, task_id), task_id, spec.config_hash())
    console.print(f"pilot: {escape(plan.reason)}", highlight=False)
    return plan


def _recover(args, spec, options: PilotOptions, console) -> int | None:
    """``--task-id``: the exit code when this task's pilot is not to run now; None to run it (``options.resume``
    set when it continues a pilot cut short)."""
    from ..pilot.recovery import Recovery

    if args.resume:
        raise UsageError("--task-id decides itself whether to --resume: give one of them")
    plan = task_recovery(args.task_id, args.ledger, spec, console)
    if plan.action == Recovery.PROVEN:
        return EXIT_OK
    if plan.action == Recovery.FAILED:
        return EXIT_GATE_FAILED
    if plan.action == Recovery.RESUME:
        options.resume = plan.run_id
    return None


def _stopped(stop: PilotInterrupted, spec, args, console) -> None:
    """What a stop signal left: the run recorded as interrupted, by which signal, and how to continue it."""
    result = stop.result
    done = len(result.rows)
    console.print(f"[bold yellow]interrupted ({stop.how})[/]: run {escape(result.run_id)} recorded as interrupted "
                  f"after {done} gate row(s) (ledger {escape(str(result.ledger_path))})", highlight=False)
    if result.world_size > 1:  # --resume continues one process of pilotrun's loop
        console.print("  a distributed pilot is continued by running it again", highlight=False)
        return
    words = ["pilotrun", "run", str(args.spec), "--resume", result.run_id]
    words += ["--ledger", str(args.ledger)] if args.ledger else []
    words += [w for item in args.overrides for w in ("--set", item)]  # --resume needs the same config
    how = ("keeping the runs of the program it finished" if not driver_class(spec).in_process
           else "from its last good checkpoint")
    console.print(f"  continue it, {how}: {escape(shlex.join(words))}", highlight=False)


def _advise_after_oom(spec, result, console) -> None:
    """A gate that ran out of accelerator memory gets the advisor's variants, and a note in the ledger."""
    oom = [r for r in result.records if r.verdict == Verdict.FAIL and r.failure == Failure.OUT_OF_MEMORY]
    if not oom or not driver_class(spec).in_process:  # the advisor traces pilotrun's loop, not a program's
        return
    from ..estimate.advise import advise
    from ..estimate.catalog import load_catalog, local_accelerator
    from ..estimate.measured import measured_fixes
    from ..estimate.runner import Traces
    from ..ledger.store import Ledger

    catalog = load_catalog()
    acc = local_accelerator(catalog)
    if acc is None:
        return
    try:
        with console.status("out of memory: tracing variants that would fit..."):
            with Ledger(result.ledger_path) as led:
                measured = measured_fixes(led, spec.config_hash())
            variants = advise(spec, Traces(spec), acc, strategies.one_process().name, 1, catalog, measured=measured)
    except Exception as exc:  # advice is a help, never a second failure
        console.print(f"[yellow]no advice: {type(exc).__name__}: {escape(str(exc))}[/]")
        return
    console.print(f"[bold yellow]{oom[0].gate} ran out of memory on {acc.name}; variants in order "
                  "(the maximum length is never cut):[/]")
    lines = []
    for v in variants:
        slower = f", {v.time_factor:.2f}x time" if v.time_factor else ""
        line = (f"{'fits' if v.fits else 'no  '}  {v.variant}: {v.device_used_bytes / 2**30:.1f} GiB per GPU"
                f"{slower}; {v.experiment}")
        lines.append(line)
        console.print("  " + line, highlight=False)
    with Ledger(result.ledger_path) as led:
        led.add_note(result.run_id, "advisor after out of memory:\n" + "\n".join(lines))
