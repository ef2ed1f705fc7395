"""The gates on a program (``program:`` in the spec): run it as control, interrupted and resumed, and turn what it
reported into one row per gate and rank, in the registry's order.

How each gate runs on a program is declared in :data:`pilotrun.gates.registry.PROGRAM_GATES`: ``lock`` and
``resume`` are pilotrun's own; ``load``, ``first_step``, ``steady_step``, ``eval`` and ``save`` are the stages the
control run reported (each rank's); gates an integration records (``job.record_gate``) are taken from the control
run; everything else is ``skip`` with the reason and what would enable it — never a silent pass.

Example::

    result = run_program_pilot(load_spec("examples/own-loop/pilot.yaml", allow_program=True), ProgramOptions())
    [(r["gate"], r["verdict"]) for r in result.rows]
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..api import measured_summary
from ..config.spec import Spec
from ..devices import query_devices
from ..gates.lock import LockGate
from ..gates.registry import GATE_NAMES, PROGRAM_GATES, OnProgram, select_gates
from ..humanize import human_seconds
from ..interrupt import as_interrupted
from ..ledger.records import Failure, GateRow, RunKind, RunStatus, Verdict, new_run_id, now
from ..ledger.store import Ledger
from ..measure.meter import StageMeter
from ..pilot.report import PilotResult, write_report
from .env import Event, Role
from .resume import fresh_runs_agree, resume_rows, short_of
from .runner import RunOutcome, RunPlan, run_program


@dataclass
class ProgramOptions:
    out_dir: Path | None = None
    ledger_path: Path | None = None
    gates: list[str] | None = None
    container_digest: str | None = None
    run_id: str | None = None


@dataclass
class _LockContext:
    """What the lock gate reads from a pilot's context, for a program pilot (no model, no driver)."""

    spec: Spec
    run_id: str
    out_dir: Path
    ledger: Ledger | None
    container_digest: str | None
    lock: dict | None = None
    rank: int = 0
    world_size: int = 1


@dataclass
class _Rows:
    result: PilotResult
    ledger: Ledger
    spec: Spec
    observer: Any
    rows: list[dict] = field(default_factory=list)

    def add(self, row: GateRow | dict) -> None:
        out = row.to_dict() if isinstance(row, GateRow) else row
        self.ledger.add_gate_row(self.result.run_id, out)
        self.result.rows.append(out)
        write_report(self.result, self.spec)
        self.observer.on_gate_end(out)


def compare_mode(spec: Spec) -> tuple[bool, str]:
    """(bitwise?, why) — the automatic choice records its reason."""
    assert spec.program is not None
    mode = spec.program.compare
    if mode == "bitwise":
        return True, "bitwise (program.compare: bitwise)"
    if mode == "rtol":
        return False, f"within rtol {spec.pilot.resume.rtol:g} (program.compare: rtol)"
    if query_devices().runtime.indexed:  # a CUDA/ROCm device (an MPS machine has compared bitwise so far)
        return False, (f"within rtol {spec.pilot.resume.rtol:g}: this machine has an accelerator, so the program may "
                       "not run in CPU fp32 (program.compare: auto)")
    return True, "bitwise: no accelerator on this machine, so the program ran on CPU (program.compare: auto)"


def run_program_pilot(spec: Spec, options: ProgramOptions | None = None, observer: Any = None) -> PilotResult:
    """Run the selected gates on the spec's program; a gate failure is a row, never an exception."""
    assert spec.program is not None
    options = options or ProgramOptions()
    observer = observer or _Quiet()
    gates, notes = select_gates(options.gates or spec.pilot.gates)
    names = [g.name for g in gates]
    run_id = options.run_id or new_run_id(spec.name)
    out_dir = Path(options.out_dir) if options.out_dir else Path("runs") / run_id
    out_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(options.ledger_path)
    result = PilotResult(run_id, out_dir, ledger.path)
    ledger.start_run(run_id, spec.name, RunKind.PILOT, spec_path=spec.source, out_dir=str(out_dir.resolve()),
                     config_hash=spec.config_hash(),
                     meta={"gates": names, "notes": notes, "program": spec.program.words})
    observer.on_start(run_id, out_dir, names, notes + [f"program: {' '.join(spec.program.words)}"])
    sink = _Rows(result, ledger, spec, observer)
    try:
        _pilot(spec, options, names, sink, out_dir, run_id, ledger.path, observer)
        result.status = RunStatus.of_pilot(result.rows)
    except KeyboardInterrupt as exc:  # Ctrl-C/SIGTERM: the program's tree is already killed (runner); recorded
        stop = as_interrupted(exc)
        result.status, result.interrupted_by = RunStatus.INTERRUPTED, stop.name
        ledger.merge_meta(run_id, {"interrupted_by": stop.name})
        raise stop from None
    finally:
        if result.status == RunStatus.RUNNING:
            result.status = RunStatus.ERROR
        ledger.end_run(run_id, result.status)
        write_report(result, spec)
        ledger.close()
    return result


def _pilot(spec: Spec, options: ProgramOptions, names: list[str], sink: _Rows, out_dir: Path, run_id: str,
           ledger_path: Path, observer: Any) -> None:
    assert spec.program is not None
    before, after = spec.pilot.resume.before, spec.pilot.resume.after
    if "lock" in names:
        sink.add(_lock_row(spec, options, run_id, out_dir, sink.ledger))

    def progress(text: str) -> None:
        observer.on_progress(0, 1, text)

    runs: dict[Role, RunOutcome] = {}
    wants_runs = any(PROGRAM_GATES[n][0] in (OnProgram.STAGE, OnProgram.INTEGRATION) or n == "resume" for n in names)
    if wants_runs:
        stage_gates = [n for n in names if PROGRAM_GATES[n][0] == OnProgram.STAGE]
        observer.on_gate_start((stage_gates or [n for n in names if n != "lock"])[0])
        role = Role.CONTROL if "resume" in names else Role.STAGES
        # The control run saves after N like the interrupted run, so both do the same work up to the kill (and the
        # save stage is measured); it then runs on to N+K uninterrupted.
        runs[role] = run_program(spec.program, spec.folder, RunPlan(role, save_at=(before,), stop_at=before + after),
                                 out_dir, run_id, ledger_path, progress)
    recording = next((run for role, run in runs.items() if role.records), None)
    # Without the resume gate (which reports them first), invalid values the program reported go on the steady_step
    # rows (else first_step's): a value is never refused silently.
    stage_names = [n for n in ("steady_step", "first_step") if n in names]
    problems_gate = stage_names[0] if "resume" not in names and stage_names else None
    if recording is not None and "resume" not in names and problems_gate is None and recording.of(Event.PROBLEM):
        sink.ledger.add_note(run_id, "invalid values the program reported: " + "; ".join(
            f"update {e.get('update')}: {e['problem']}" for e in recording.of(Event.PROBLEM)))
    for name in names:
        if name == "lock":
            continue
        how, why = PROGRAM_GATES[name]
        if name == "resume":
            assert recording is not None
            observer.on_gate_start("resume")
            exact, mode = compare_mode(spec)
            if (not recording.ended_cleanly or not any(recording.updates(r) for r in recording.ranks)
                    or short_of(recording, before + after) is not None):
                # The row names the control run's failure; two more runs would each cost up to program.timeout
                # (found piloting a program that ignores should_stop: control, interrupted and resumed all timed out;
                # and a Lightning script whose max_steps was below pilot.resume.before + after).
                for row in resume_rows(runs, before, after, exact, spec.pilot.resume.rtol, mode):
                    sink.add(row)
                continue
            runs[Role.INTERRUPTED] = run_program(
                spec.program, spec.folder, RunPlan(Role.INTERRUPTED, save_at=(before,), stop_at=before + after,
                                                   kill_after_save=before), out_dir, run_id, ledger_path, progress)
            saved = runs[Role.INTERRUPTED].of(Event.SAVED, 0)
            if runs[Role.INTERRUPTED].killed and not runs[Role.INTERRUPTED].survivors and saved and fresh_runs_agree(
                    recording, runs[Role.INTERRUPTED], before, exact, spec.pilot.resume.rtol):
                runs[Role.RESUMED] = run_program(
                    spec.program, spec.folder, RunPlan(Role.RESUMED, stop_at=before + after,
                                                       resume_from=saved[-1]["path"]),
                    out_dir, run_id, ledger_path, progress)
            for row in resume_rows(runs, before, after, exact, spec.pilot.resume.rtol, mode):
                sink.add(row)
            continue
        if recording is None:
            continue
        if how == OnProgram.STAGE:
            rows = _stage_rows(name, recording, why)
            if name == problems_gate:
                _mark_problems(rows, recording)
            for row in rows:
                sink.add(row)
        elif how == OnProgram.INTEGRATION:
            recorded = [e["row"] for e in recording.of(Event.GATE) if e["row"].get("gate") == name]
            if recorded:
                for mapping in recorded:
                    sink.add(GateRow.from_mapping(mapping))
            else:
                sink.add(GateRow.now(name, Verdict.SKIP, f"not measured on a program: {why}",
                                     details={"on_program": str(how)}))
        else:
            sink.add(GateRow.now(name, Verdict.SKIP, f"not measured on a program: {why}",
                                 details={"on_program": str(how)}))
    if recording is not None:
        unknown = sorted({e["row"].get("gate") for e in recording.of(Event.GATE)} - set(GATE_NAMES))
        if unknown:
            sink.ledger.add_note(run_id, f"the program recorded rows for unknown gate(s) {unknown}; known: "
                                         f"{', '.join(GATE_NAMES)}")


def _lock_row(spec: Spec, options: ProgramOptions, run_id: str, out_dir: Path, ledger: Ledger) -> GateRow:
    ctx = _LockContext(spec, run_id, out_dir, ledger, options.container_digest)
    started = now()
    with StageMeter(torch.device("cpu")) as meter:
        outcome = LockGate().run(ctx, meter)
    lock = ctx.lock or {}
    program = lock.get("program", {})
    outcome.details["program"] = program
    outcome.reason = (f"{outcome.reason}; program: {len(program.get('files', {}))} file(s) hashed "
                      f"({program.get('files_from')}), command recorded")
    return GateRow("lock", outcome.verdict, outcome.reason, inputs=outcome.inputs, memory=meter.memory,
                   seconds=meter.seconds, started_at=started, ended_at=now(), details=outcome.details)


def _stage_rows(name: str, run: RunOutcome, enable: str) -> list[GateRow]:
    """One row per rank from the stages the run reported under ``name``; skip (or fail, when the run crashed before
    reporting it) where there is none."""
    if not any(e["row"].get("gate") == name for e in run.of(Event.STAGE)):
        if not run.ended_cleanly:
            return [GateRow.now(name, Verdict.FAIL, f"the {run.role} run {run.how_it_ended()} before reporting "
                                f"the {name!r} stage (log: {run.log})", failure=Failure.ERROR,
                                details={"log": str(run.log)})]
        return [GateRow.now(name, Verdict.SKIP, f"not measured: the program reported no {name!r} stage; {enable}",
                            details={"on_program": "stage"})]
    out = []
    for rank in run.ranks:
        rows = [e["row"] for e in run.of(Event.STAGE, rank) if e["row"].get("gate") == name]
        if not rows:
            out.append(GateRow.now(name, Verdict.SKIP, f"not measured on rank {rank}: it reported no {name!r} stage "
                                   "(other ranks did)", rank=rank, world_size=run.world_size,
                                   details={"on_program": "stage"}))
            continue
        if name == "first_step" or len(rows) == 1:
            row = GateRow.from_mapping(rows[0])
            if len(rows) > 1:
                row.details = {**row.details, "note": f"{len(rows)} first_step stages reported; the first is kept"}
        else:
            row = combine(name, rows)
        row.rank = rank
        out.append(row)
    return out


def _mark_problems(rows: list[GateRow], run: RunOutcome) -> None:
    """Each rank's refused values fail (non-finite) or warn its row, naming the update and field."""
    for row in rows:
        problems = run.of(Event.PROBLEM, row.rank)
        if not problems:
            continue
        text = "; ".join(f"update {e.get('update')}: {e['problem']}" for e in problems[:3])
        row.details = {**row.details, "problems": problems}
        if any(e.get("non_finite") for e in problems):
            row.verdict, row.failure, row.reason = Verdict.FAIL, Failure.NON_FINITE, f"the program reported {text}"
        elif row.verdict != Verdict.FAIL:
            row.verdict, row.reason = Verdict.WARN, f"{row.reason}; the program reported invalid values: {text}"


def combine(name: str, rows: list[dict]) -> GateRow:
    """Several stages of one name on one rank (steady_step per update, eval per evaluation): the worst verdict, the
    median time, each memory counter's largest value (counters stay apart)."""
    worst = min(rows, key=lambda r: Verdict(r["verdict"]).severity)
    seconds = [r["seconds"] for r in rows if r.get("seconds") is not None]
    memory: dict[str, Any] = {}
    for r in rows:
        for key, value in (r.get("memory") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                memory[key] = max(value, memory.get(key, value))
            else:
                memory.setdefault(key, value)
    median = statistics.median(seconds) if seconds else None
    summary = measured_summary(median, memory)
    reason = worst["reason"] if worst["verdict"] != Verdict.PASS else (
        f"{len(rows)} stages: median {human_seconds(median)} ({human_seconds(min(seconds))}–"
        f"{human_seconds(max(seconds))}); the largest peaks of them: {summary.partition('; ')[2] or 'not measured'}"
        if median is not None else f"{len(rows)} stages; time not measured")
    return GateRow(name, Verdict(worst["verdict"]), reason, inputs=rows[0].get("inputs") or {}, memory=memory,
                   seconds=median, started_at=rows[0]["started_at"], ended_at=rows[-1]["ended_at"],
                   details={"count": len(rows), "seconds_each": seconds, **(worst.get("details") or {})},
                   world_size=rows[0].get("world_size", 1))


class _Quiet:
    def on_start(self, *a) -> None: ...
    def on_gate_start(self, *a) -> None: ...
    def on_progress(self, *a) -> None: ...
    def on_gate_end(self, *a) -> None: ...
