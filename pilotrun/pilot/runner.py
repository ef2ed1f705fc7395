"""Run the gates of one pilot in order; every gate writes its rows to the ledger and ``report.json``.

One runner for every driver: pilotrun's own loop (the load gate builds it, the gates run on it in this process) and
the user's own program (``program:`` in the spec: the driver is built before the gates and proves each one as the
gate's ``on_program`` declares — from the program's reported stages and recorded rows, or by running it again for
the resume proof — with one row per gate and rank). This module decides nothing about presentation: an observer
(the terminal UI, or nothing in tests) is told when gates start, progress and end. What runs, what is skipped and
why, and what ``--resume`` keeps all come from the gates' declarations (:mod:`pilotrun.gates.registry`).

Example::

    from pilotrun.config import load_spec
    from pilotrun.pilot import PilotOptions, run_pilot
    result = run_pilot(load_spec("examples/tiny-sft/pilot.yaml"), PilotOptions())
    print(result.status, [r.verdict for r in result.records])
"""
from __future__ import annotations

import contextlib
import json
import traceback
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from .. import distributed
from ..config.spec import Spec
from ..drivers import RunSite, build_driver, check_job, driver_class, join_job
from ..gates import GATE_NAMES, Gate, Outcome, PilotContext, Product, depends_on, select_gates
from ..gates.base import fail_outcome, stops_the_pilot
from ..interrupt import Interrupted, as_interrupted
from ..ledger.records import GateRow, RunKind, RunStatus, Verdict, new_run_id, now
from ..ledger.store import Ledger, LedgerWriteFailed
from ..measure.meter import StageMeter
from ..models.quiet import QuietTransformers
from ..safefile import WriteFailed, write_atomic
from .report import FALLBACK_FILE, PilotResult, write_report
from .resume import ResumePlan, carry_rows, plan_program_resume, plan_resume


class Observer(Protocol):
    def on_start(self, run_id: str, out_dir: Path, gates: list[str], notes: list[str]) -> None: ...
    def on_gate_start(self, gate: str) -> None: ...
    def on_progress(self, done: int, total: int, text: str) -> None: ...
    def on_gate_end(self, row: GateRow) -> None: ...


class Quiet:
    """The observer that shows nothing (tests, ranks other than 0)."""

    def on_start(self, *a) -> None: ...
    def on_gate_start(self, *a) -> None: ...
    def on_progress(self, *a) -> None: ...
    def on_gate_end(self, *a) -> None: ...


@dataclass
class PilotOptions:
    out_dir: Path | None = None          # default: runs/<run_id>
    ledger_path: Path | None = None      # default: runs/ledger.sqlite ($PILOTRUN_LEDGER)
    gates: list[str] | None = None       # default: spec.pilot.gates, else all
    container_digest: str | None = None
    run_id: str | None = None
    resume: str | None = None            # "latest" or a run id: continue an interrupted pilot
    trust: bool = False                  # load a checkpoint whose manifest the ledger did not record
    proven_lock: tuple[str, dict] | None = None  # (where from, lock.json): what the lock gate compares with
    task_id: str | None = None           # the task running this pilot, the same across its restarts (run meta)


class PilotInterrupted(Interrupted):
    """A stop signal during the gates: the run is already recorded as interrupted (the signal in its meta,
    ``interrupted_by``) and ``--resume`` continues it; ``result`` is what the pilot came to so far."""

    def __init__(self, signum: int, result: PilotResult) -> None:
        super().__init__(signum)
        self.result = result


def _short(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class _Progress:
    """What the gates so far came to: the verdict every rank agreed on, and for skipped gates the root cause."""

    verdicts: dict[str, tuple[str, Verdict]] = field(default_factory=dict)  # gate -> (reason, verdict) over ranks
    # skipped gate -> (the gate behind it, its reason, its verdict: failed, or skipped as not measured)
    root_causes: dict[str, tuple[str, str, Verdict]] = field(default_factory=dict)

    def blockers(self, gate: type[Gate]) -> list[str]:
        return [d for d in depends_on(gate) if self.verdicts.get(d, ("", Verdict.SKIP))[1].blocks]


def run_pilot(spec: Spec, options: PilotOptions | None = None, observer: Observer | None = None) -> PilotResult:
    """Run the selected gates; never raises for a gate failure (it becomes a row)."""
    options = options or PilotOptions()
    observer = observer or Quiet()
    gates, notes = select_gates(options.gates or spec.pilot.gates)
    process = join_job(spec)
    env = process.env
    try:
        check_job(spec, process.device)  # an adapter the model cannot take, a fused kernel torch lacks: exit 2
    except BaseException:
        distributed.shutdown(env)
        raise
    if env.active:
        if not env.is_main:
            observer = Quiet()
        if options.resume:
            distributed.shutdown(env)
            raise distributed.LaunchError("--resume continues one process; resume a distributed pilot by running it "
                                          "again")
    run_id = distributed.agree_run_id(env, options.run_id, lambda: new_run_id(spec.name), spec.config_hash())
    out_dir = Path(options.out_dir) if options.out_dir else Path("runs") / run_id
    ledger = Ledger(options.ledger_path)
    in_process = driver_class(spec).in_process
    try:
        plan = (plan_resume(ledger, spec.name, options.resume, options.trust, spec.canonical(), spec.config_hash())
                if options.resume and in_process else None)
        program_plan = plan_program_resume(ledger, spec, options.resume) if options.resume and not in_process else None
    except BaseException:
        ledger.close()
        raise
    # Only once there is something to run: a refused --resume leaves no empty run folder behind.
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = PilotContext(spec=spec, run_id=run_id, out_dir=out_dir, process=process, ledger=ledger,
                       container_digest=options.container_digest, progress=observer.on_progress,
                       restore_from=plan.checkpoint if plan is not None else None, proven_lock=options.proven_lock)
    carried = carry_rows(plan, gates, ctx) if plan is not None else {}
    notes = notes + (plan.notes if plan is not None else []) + (program_plan.notes if program_plan else [])
    parent_id = plan.parent_id if plan is not None else program_plan.parent_id if program_plan else None
    result = PilotResult(run_id, out_dir, ledger.path, rank=env.rank, world_size=env.world_size)
    if env.is_main:
        ledger.start_run(run_id, spec.name, RunKind.PILOT, spec_path=spec.source, out_dir=str(out_dir.resolve()),
                         config_hash=spec.config_hash(), meta={"gates": [g.name for g in gates], "notes": notes,
                                                               **driver_class(spec).job_meta(spec, process),
                                                               **({"task_id": options.task_id} if options.task_id
                                                                  else {})},
                         parent_id=parent_id)
    distributed.barrier(env)
    node_row = _register_on_this_node(ledger, env, run_id, spec, out_dir, options.task_id)
    distributed.barrier(env)  # this node's ranks write rows only once the run is in its ledger
    observer.on_start(run_id, out_dir, [g.name for g in gates], notes + [driver_class(spec).where(spec, process)])
    if not in_process:  # the program: built from the spec alone, before its gates
        site = RunSite(run_id, out_dir, ledger.path, progress=lambda text: observer.on_progress(0, 1, text),
                       finished=program_plan.reused if program_plan else {})
        ctx.driver = build_driver(spec, None, process, site=site)
        ctx.driver.prepare(gates, GATE_NAMES)
    progress = _Progress()
    stop: Interrupted | None = None
    try:
        with QuietTransformers() as quiet:
            for gate_cls in gates:
                quiet.settle()  # after a load gate that imported transformers
                _one_gate(gate_cls, ctx, carried, plan, observer, result, progress)
        result.status = RunStatus.of_pilot(result.rows)
        if env.active:
            result.all_rows = [r for rows in distributed.gather(env, result.rows) for r in rows]
            result.status = RunStatus.of_pilot(result.all_rows)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP under pilotrun.interrupt.interruptible()
        stop = as_interrupted(exc)
        result.status, result.interrupted_by = RunStatus.INTERRUPTED, stop.name
    except LedgerWriteFailed as exc:  # the disk filled mid-run: the end goes to a file beside the run instead
        result.status = RunStatus.ERROR
        result.ledger_failure = exc
    finally:
        _close(ctx, result, spec, ledger, node_row)
    if result.ledger_failure is not None:
        raise LedgerWriteFailed(result.ledger_failure.path, f"{result.ledger_failure.cause}; the run's end and its "
                                f"rows are in {_fallback(result, result.ledger_failure)}") from None
    if stop is not None:
        raise PilotInterrupted(stop.signum, result) from None
    return result


def _fallback(result: PilotResult, exc: LedgerWriteFailed) -> str:
    """The run's end beside the run (``ledger-fallback.json``): its status, rows and why the ledger refused them;
    where it is, or why it could not be written either."""
    path = result.out_dir / FALLBACK_FILE
    try:
        write_atomic(path, json.dumps({"run_id": result.run_id, "ledger": str(result.ledger_path),
                                       "status": str(result.status), "ended_at": now(), "ledger_error": str(exc),
                                       "rows": result.rows}, indent=1, default=str))
    except WriteFailed as also:
        return f"no file either ({also})"
    return str(path)




def _one_gate(gate_cls: type[Gate], ctx: PilotContext, carried: dict[str, GateRow], plan: ResumePlan | None,
              observer: Observer, result: PilotResult, progress: _Progress) -> None:
    """Decide whether the gate runs, is skipped, carried or proven by the driver; write its rows everywhere."""
    started = ctx.driver is not None and not ctx.driver.in_process
    if started:
        assert ctx.driver is not None
        observer.on_gate_start(gate_cls.name)  # a program's rows may take a run of it to prove
        proven = ctx.driver.proven_rows(gate_cls)
        if proven is not None:
            _write_rows(gate_cls.name, proven, [], ctx, result, progress, observer)
            return
    gate = gate_cls()
    metrics: list[dict] = []
    blockers = progress.blockers(gate_cls)
    if not blockers and Product.DATA in gate.needs and ctx.data_error is not None:
        first = next((r.gate for r in result.records if r.verdict == Verdict.FAIL), "an earlier gate")
        row = _skip_row(gate, ctx, f"skipped: the data could not be built in {first} ({_short(ctx.data_error)})")
    elif gate.name in carried and plan is not None:
        row = _carried_row(carried[gate.name], plan.parent_id)
    elif blockers:
        dep = blockers[0]
        root, root_reason, root_verdict = progress.root_causes.get(dep, (dep, *progress.verdicts[dep]))
        via = f"needs {dep}, skipped because " if root != dep else ""
        what = "failed" if root_verdict == Verdict.FAIL else "was not measured"
        row = _skip_row(gate, ctx, f"skipped: {via}{root} {what} ({_short(root_reason)})")
        progress.root_causes[gate.name] = (root, root_reason, root_verdict)
    elif ctx.driver is not None and (missing := [c for c in gate.requires if not ctx.driver.can(c)]):
        row = _skip_row(gate, ctx, f"not measured: the {ctx.driver.name} driver cannot "
                        + "; nor ".join(c.missing for c in missing))
        progress.root_causes[gate.name] = (gate.name, row.reason, Verdict.SKIP)
    else:
        if not started:
            observer.on_gate_start(gate.name)
        row, metrics = _run_gate(gate, ctx)
        if row.verdict == Verdict.SKIP:  # it ran and could not measure: the gates after it name it as the cause
            progress.root_causes[gate.name] = (gate.name, row.reason, Verdict.SKIP)
    if row.verdict == Verdict.SKIP and gate.name not in progress.root_causes and not blockers:
        fail = next((r for r in result.records if r.verdict == Verdict.FAIL), None)
        progress.root_causes[gate.name] = ((fail.gate, fail.reason, Verdict.FAIL) if fail else
                                           ("data", ctx.data_error or "", Verdict.FAIL))
    row.rank, row.world_size = ctx.rank, ctx.world_size
    _write_rows(gate.name, [row], metrics, ctx, result, progress, observer)


def _write_rows(gate: str, rows: list[GateRow], metrics: list[dict], ctx: PilotContext, result: PilotResult,
                progress: _Progress, observer: Observer) -> None:
    """A gate's rows (one, or a program's one per rank) to the ledger, the report and the observer; the gate's
    verdict for the gates after it is its worst row's, agreed over this pilot's ranks."""
    for row in rows:
        out = row.to_dict()  # the JSON form: the report and the ledger keep it
        result.rows.append(out)  # before the ledger: a row a full disk refused is still in the fallback file
        if ctx.ledger is not None:
            ctx.ledger.add_gate_row(ctx.run_id, out, metrics)
        write_report(result, ctx.spec)
        observer.on_gate_end(row)
    worst = min(rows, key=lambda r: r.verdict.severity)
    progress.verdicts[gate] = _agreed_verdict(ctx.env, worst)


def _register_on_this_node(ledger: Ledger, env: distributed.DistEnv, run_id: str, spec: Spec, out_dir: Path,
                           task_id: str | None = None) -> bool:
    """On a node of a multi-node launch whose ledger is its own file (another machine), the run goes in it too,
    so the node's ranks can write their rows there. Where the ledger is shared, rank 0's row is already in it. With
    the task's id, as rank 0 records it: a restarted task finds its pilot in whichever node's ledger it reads."""
    if not env.active or env.is_main or env.local_rank != 0:
        return False
    if ledger.has_run(run_id):
        return False
    ledger.start_run(run_id, spec.name, RunKind.PILOT, spec_path=spec.source, out_dir=str(out_dir.resolve()),
                     config_hash=spec.config_hash(),
                     meta={"world_size": env.world_size, "node_first_rank": env.rank,
                           **({"task_id": task_id} if task_id else {}),
                           "notes": [f"this ledger holds the rows of the ranks on this node (from rank {env.rank}); "
                                     "rank 0's node holds the combined report.json"]})
    return True


def _close(ctx: PilotContext, result: PilotResult, spec: Spec, ledger: Ledger, node_row: bool = False) -> None:
    if ctx.driver is not None:
        if ctx.env.is_main:
            for text in ctx.driver.notes():
                ledger.add_note(result.run_id, text)
        ctx.driver.close()
    ctx.driver = None  # the DDP/FSDP model goes before the process group (distributed.shutdown)
    if result.status == RunStatus.RUNNING:
        result.status = RunStatus.ERROR
    if (ctx.env.is_main or node_row) and result.ledger_failure is None:
        try:
            if result.interrupted_by:
                ledger.merge_meta(result.run_id, {"interrupted_by": result.interrupted_by})
            ledger.end_run(result.run_id, result.status)
        except LedgerWriteFailed as exc:
            result.status, result.ledger_failure = RunStatus.ERROR, exc
    try:
        write_report(result, spec)
    finally:
        ledger.close()
    if result.status not in (RunStatus.ERROR, RunStatus.INTERRUPTED):
        distributed.shutdown(ctx.env)


def _carried_row(parent_row: GateRow, parent_id: str) -> GateRow:
    """A gate the interrupted run already passed: its row, marked as carried, not re-measured (this run's rank and
    world size, not the parent's)."""
    return replace(parent_row, reason=f"carried from {parent_id}: {parent_row.reason}",
                   details={**parent_row.details, "carried_from": parent_id}, rank=0, world_size=1)


def _skip_row(gate: Gate, ctx: PilotContext, reason: str) -> GateRow:
    return GateRow.now(gate.name, Verdict.SKIP, reason, inputs=gate.describe_inputs(ctx))


def _agreed_verdict(env: distributed.DistEnv, row: GateRow) -> tuple[str, Verdict]:
    """(reason, verdict) of a gate over ranks: its worst rank's. Every rank then runs or skips the same gates,
    as the collectives inside them require."""
    if not env.active:
        return row.reason, row.verdict
    rows = distributed.gather(env, (str(row.verdict), row.reason, env.rank))
    verdict, reason, rank = min(rows, key=lambda v: Verdict(v[0]).severity)
    return (reason if rank == env.rank else f"rank {rank}: {reason}"), Verdict(verdict)


def _run_gate(gate: Gate, ctx: PilotContext) -> tuple[GateRow, list[dict]]:
    """Run one gate under a meter; its row and the per-update points it measured."""
    started = now()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with StageMeter(ctx.device, track=gate.track(ctx), tensor_tracking=gate.tensor_tracking) as meter:
            try:
                outcome = gate.run(ctx, meter)
            except BaseException as exc:  # a gate failure is a row, never a crash: sys.exit, os._exit (exitguard)
                # or any BaseException subclass user code raises; Ctrl-C and pilotrun's own stops end the pilot
                if stops_the_pilot(exc):
                    raise
                outcome = fail_outcome(gate, exc, ctx)
                outcome.details.update(_keep_traceback(ctx.out_dir / f"{gate.name}.traceback.txt", exc))
    return _measured_row(gate, ctx, outcome, meter, started, caught or []), outcome.metrics


def _keep_traceback(path: Path, exc: BaseException) -> dict:
    """Write a failed gate's traceback; on a full or read-only disk the row still gets its tail (and says where the
    file could not be written) instead of the write raising out of the pilot and losing the row."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        path.write_text(text)
        return {"traceback": str(path)}
    except OSError as write_error:
        with contextlib.suppress(OSError):
            path.unlink()  # never leave an empty traceback file behind
        return {"traceback_not_written": f"{path}: {write_error.strerror or write_error}",
                "traceback_tail": text[-4000:]}


def _measured_row(gate: Gate, ctx: PilotContext, outcome: Outcome, meter: StageMeter, started: str,
                  caught: list[warnings.WarningMessage]) -> GateRow:
    details = dict(outcome.details)
    messages = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:200]}" for w in caught})
    if messages:
        details["warnings"] = messages[:20]
    return GateRow(gate.name, outcome.verdict, outcome.reason or str(outcome.verdict),
                   inputs=outcome.inputs or gate.describe_inputs(ctx),
                   memory=outcome.memory if outcome.memory is not None else meter.memory,
                   seconds=meter.seconds, started_at=started, ended_at=now(), details=details,
                   failure=outcome.failure if outcome.verdict == Verdict.FAIL else None)
