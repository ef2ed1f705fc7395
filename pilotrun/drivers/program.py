"""The user's own training program as a driver (``program:`` in the spec; docs/guides/program.md).

The program runs in child processes (:mod:`pilotrun.program.runner`); this driver turns what it reported into the
pilot's rows, as each gate declares (``Gate.on_program``):

- ``PILOT`` gates (lock) run in the pilot's own process as for any job (:meth:`ProgramDriver.proven_rows` is None);
- ``RUNS`` (resume): control, interrupted (SIGKILL after its save) and resumed runs, compared update by update;
- ``STAGE`` gates: the stages the recording run reported, one row per rank (several of one name combined);
- ``INTEGRATION`` gates: the rows an integration recorded inside the program (``job.record_gate``); an export's
  manifest digest on its row (what makes a folder *known* to the loading policy) is never the program's word: pilotrun
  admits the folder itself (every file against the manifest it read once, inside the run's checkpoint folder) and
  records the digest of those bytes, and a reload_eval row stands only on an export that passed that check;
- ``NEVER``: a skip row with the reason and what would enable it — never a silent pass.

One recording run serves every gate: it starts when the first gate needs it. With the resume gate selected it is the
control run, which saves after ``pilot.resume.before`` like the interrupted run (so both do the same work up to the
kill, and the save stage is measured) and runs on to ``before + after`` uninterrupted. With ``before: auto`` (the
default) nothing is asked of the control: its first save is the program's own checkpoint (or, if it has made none
by ``auto_within``, one pilotrun asks for there, said as a warning), and it stops ``after`` updates later; the
interrupted run is then killed after that same save.

Example::

    from pilotrun.pilot import PilotOptions, run_pilot
    result = run_pilot(load_spec("examples/own-loop/pilot.yaml", allow_program=True), PilotOptions())
    [(r.gate, r.verdict) for r in result.records]
"""
from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..api import peaks_phrase
from ..checkpoint.io import CheckpointError
from ..checkpoint.trust import LoadPolicy
from ..config.load import LOOP_RESUME_BEFORE
from ..config.paths import GlobRefused
from ..config.program import program_files
from ..config.spec import Spec
from ..devices import query_devices
from ..humanize import human_seconds
from ..ledger.records import Failure, GateName, GateRow, Verdict
from ..program.compare import CompareChoice, CompareMode
from ..program.describe import integration_needed
from ..program.env import Event, Role
from ..program.resume import (
    fresh_runs_agree,
    no_own_save_row,
    no_room_row,
    resume_rows,
    save_point,
    short_of,
    with_save_point,
)
from ..program.runner import RunOutcome, RunPlan, run_program
from .base import Capability, Driver, GateDeclaration, JobProcess, OnProgram, RunSite


def compare_choice(spec) -> CompareChoice:
    """How the resume gate compares the program's runs; the automatic choice records its reason."""
    assert spec.program is not None
    mode, rtol = spec.program.compare, spec.pilot.resume.rtol
    if mode != "auto":
        return CompareChoice(CompareMode(mode), rtol, f"program.compare: {mode}")
    if query_devices().runtime.indexed:  # a CUDA/ROCm device (an MPS machine has compared bitwise so far)
        return CompareChoice(CompareMode.RTOL, rtol, "program.compare: auto; this machine has an accelerator, so the "
                                                     "program may not run in CPU fp32")
    return CompareChoice(CompareMode.BITWISE, rtol, "program.compare: auto; no accelerator on this machine, so the "
                                                    "program ran on CPU")


class ProgramDriver(Driver):
    """Runs the spec's program as the pilot's gates need it and proves them from what it reported."""

    name = "program"
    capabilities = frozenset({Capability.UPDATES, Capability.RESTART})
    in_process = False

    @classmethod
    def job_meta(cls, spec: Spec, process: JobProcess) -> dict:
        assert spec.program is not None
        return {"program": spec.program.words}

    @classmethod
    def where(cls, spec: Spec, process: JobProcess) -> str:
        assert spec.program is not None
        return f"program: {' '.join(spec.program.words)}"

    def __init__(self, spec, process: JobProcess, site: RunSite) -> None:
        assert spec.program is not None
        self.spec, self.site, self.program = spec, site, spec.program
        self.device, self.env, self.strategy = process.device, process.env, process.strategy
        self.step = 0
        self.how_wrapped = f"the program's own: {' '.join(spec.program.words)}"
        self.runs: dict[Role, RunOutcome] = dict(site.finished)  # an interrupted pilot's finished runs (--resume)
        self.resume_selected = False     # a RUNS gate will run: the recording run is the control
        self.problems_gate: str | None = None  # the gate whose rows carry the program's invalid values
        self.known: list[str] = []       # every gate's name, in order (a recorded row for another is named in a note)
        self.leftovers_told: set[Role] = set()  # runs whose leftovers (processes, bad event lines) a row named
        # (folder, reported digest) -> (the digest pilotrun computed, or None and why not): each folder hashed once
        self.checked: dict[tuple[Any, Any], tuple[str | None, str]] = {}
        self.integration_note: str | None = None  # read from the program's files when a row first needs it

    @classmethod
    def build(cls, spec, inputs, process: JobProcess, on_model=None, site: RunSite | None = None) -> ProgramDriver:
        if site is None:
            raise ValueError("the program driver writes into the pilot's run: give its site")
        return cls(spec, process, site)

    def prepare(self, gates: Sequence[GateDeclaration], known: Sequence[str] = ()) -> None:
        """Plan the runs from the selected gates: the recording run is the control when the resume gate runs; the
        program's invalid values go on the last stage gate that carries them when no resume row reports them."""
        self.known = list(known) or [g.name for g in gates]
        self.resume_selected = any(g.on_program == OnProgram.RUNS for g in gates)
        carriers = [g.name for g in gates if g.on_program == OnProgram.STAGE and g.program_problems]
        self.problems_gate = carriers[-1] if carriers and not self.resume_selected else None

    # -- the runs -----------------------------------------------------------------------------------------
    @property
    def auto(self) -> bool:
        """pilot.resume.before: auto — the resume is proven at the program's own first checkpoint."""
        return self.spec.pilot.resume.before == "auto"

    def _run(self, plan: RunPlan) -> RunOutcome:
        self.runs[plan.role] = run_program(self.program, self.spec.folder, plan, self.site.out_dir,
                                           self.site.run_id, self.site.ledger_path, self.site.progress)
        return self.runs[plan.role]

    def recording(self) -> RunOutcome:
        """The run whose stages and gate rows are the pilot's, started on first use."""
        role = Role.CONTROL if self.resume_selected else Role.STAGES
        r = self.spec.pilot.resume
        if self.auto and role == Role.CONTROL:
            plan = RunPlan(role, save_auto=(r.auto_within, r.after))
        else:  # the stages alone need a few updates and one save, wherever the program makes its own
            before = LOOP_RESUME_BEFORE if r.before == "auto" else r.before
            plan = RunPlan(role, save_at=(before,), stop_at=before + r.after)
        return self.runs.get(role) or self._run(plan)

    def _recorded(self) -> RunOutcome | None:
        return next((run for role, run in self.runs.items() if role.records), None)

    # -- the rows -----------------------------------------------------------------------------------------
    def proven_rows(self, gate: GateDeclaration) -> list[GateRow] | None:
        how = gate.on_program
        if how == OnProgram.PILOT:
            return None
        if how == OnProgram.NEVER:
            return [_not_on_program(gate)]
        rows = self._resume_rows() if how == OnProgram.RUNS else self._recorded_rows(gate)
        return self._name_leftovers(rows)

    def _name_leftovers(self, rows: list[GateRow]) -> list[GateRow]:
        """The first rows after a run that left processes running when it ended warn, naming each (pid, command):
        a daemon a program starts outlives its training on the rented machine too. Each run is named once."""
        runs = self._untold_leftovers()
        if not runs or all(row.verdict == Verdict.SKIP for row in rows):  # a skip is no place for it: notes() then
            return rows
        self.leftovers_told |= {run.role for run in runs}
        said = _leftovers_said(runs)
        for row in rows:
            row.details = {**row.details, "leftovers": {str(run.role): run.leftovers for run in runs if run.leftovers},
                           "event_problems": {str(run.role): run.event_problems for run in runs
                                              if run.event_problems}}
            if row.verdict == Verdict.PASS:
                row.verdict = Verdict.WARN
            row.reason = f"{row.reason}; {said}"
        return rows

    def _untold_leftovers(self) -> list[RunOutcome]:
        return [run for role, run in self.runs.items()
                if (run.leftovers or run.event_problems) and role not in self.leftovers_told]

    def _recorded_rows(self, gate: GateDeclaration) -> list[GateRow]:
        how = gate.on_program
        recording = self.recording()
        if how == OnProgram.STAGE:
            rows = [unvouched(row) for row in stage_rows(gate.name, recording, gate.program_note,
                                                         gate.program_combines)]
            if gate.name == self.problems_gate:
                mark_problems(rows, recording)
            return rows
        recorded = [unvouched(row) for row in reported(recording.of(Event.GATE), gate.name)]
        if not recorded:
            return [_not_on_program(gate, self._integration_needed())]
        if gate.name == GateName.EXPORT:
            for row in recorded:
                admitted(row, self._export_check(recording, row.details))
        elif gate.name == GateName.RELOAD_EVAL:
            exports = reported(recording.of(Event.GATE), GateName.EXPORT)
            for row in recorded:
                reload_stands(row, [self._export_check(recording, unvouched(x).details) for x in exports
                                    if x.rank == row.rank and x.verdict in (Verdict.PASS, Verdict.WARN)])
        return recorded

    def _integration_needed(self) -> str | None:
        """The integration that fits the framework the program's files use (read once, never run), for the rows of
        the gates an integration records; None: the gate's own note says what would enable it."""
        if self.integration_note is None:
            try:
                files = program_files(self.program, self.spec.folder)[0]
            except (GlobRefused, OSError):  # refused when the spec was read; the gate's own note then
                files = []
            self.integration_note = integration_needed(files) or ""
        return self.integration_note or None

    def _export_check(self, run: RunOutcome, details: dict) -> tuple[str | None, str]:
        """pilotrun's own check of the export folder a row of ``run`` names (:func:`export_check`), once per folder.
        The folder must be in the checkpoint folder pilotrun gave that run (beside its log: a run a resumed pilot
        kept ran in the folder of the pilot before it)."""
        key = (details.get("path"), details.get(REPORTED))
        if key not in self.checked:
            root = Path(os.path.abspath(run.log.parent)) / "checkpoints" / str(run.role)
            self.checked[key] = export_check(*key, root)
        return self.checked[key]

    def _resume_rows(self) -> list[GateRow]:
        """Control, then (when it can be compared) interrupted and resumed runs; one row per rank."""
        compare = compare_choice(self.spec)
        r = self.spec.pilot.resume
        control = self.recording()
        reported = control.ended_cleanly and any(control.updates(rank) for rank in control.ranks)
        point = save_point(control, r.before, r.auto_within)
        if point is None:  # auto: no save at all
            if reported:
                return [no_own_save_row(control, r.auto_within)]
            before = r.auto_within  # the control's own failure is the row (resume_rows says it)
        else:
            before = point.update
        end = before + r.after
        # A control run that failed, reported nothing or ended early is the row's whole story: two more runs would
        # each cost up to program.timeout (found piloting a program that ignores should_stop: all three timed out;
        # and a Lightning script whose max_steps was below pilot.resume.before + after).
        short = short_of(control, end) if reported and point is not None else None
        if point is not None and point.auto and short is not None:
            return [no_room_row(control, point, r.after)]
        asks = point is None or point.asks
        if reported and point is not None and short is None:
            # At the program's own checkpoint nothing is asked: the interrupted run saves there as the long run would
            # (a Lightning epoch-end ModelCheckpoint, not a save_checkpoint of pilotrun's mid-epoch).
            interrupted = self.runs.get(Role.INTERRUPTED) or self._run(
                RunPlan(Role.INTERRUPTED, save_at=(before,) if asks else (), stop_at=end, kill_after_save=before))
            saved = interrupted.of(Event.SAVED, 0)
            if interrupted.killed and not interrupted.survivors and saved and fresh_runs_agree(
                    control, interrupted, before, compare.exact, compare.rtol) and Role.RESUMED not in self.runs:
                self._run(RunPlan(Role.RESUMED, stop_at=end, resume_from=saved[-1]["path"]))
        rows = resume_rows(self.runs, before, r.after, compare, asked=asks)
        return with_save_point(rows, point, control) if point is not None else rows

    def notes(self) -> list[str]:
        recording = self._recorded()
        if recording is None:
            return []
        out = []
        if not self.resume_selected and self.problems_gate is None and recording.of(Event.PROBLEM):
            out.append("invalid values the program reported: " + "; ".join(
                f"update {e.get('update')}: {e['problem']}" for e in recording.of(Event.PROBLEM)))
        if self._untold_leftovers():
            out.append(_leftovers_said(self._untold_leftovers()))
        unknown = sorted({row.gate for row in reported(recording.of(Event.GATE))} - set(self.known))
        if unknown:
            out.append(f"the program recorded rows for unknown gate(s) {unknown}; known: {', '.join(self.known)}")
        return out


def _leftovers_said(runs: list[RunOutcome]) -> str:
    """What the runs left behind: processes still running when the program ended, event lines not read."""
    said = [f"the {run.role} run left {run.leftover_text()} running when it ended (killed by pilotrun): end them "
            "before the program exits, or wait for them" for run in runs if run.leftovers]
    said += [f"the {run.role} run's events: {'; '.join(run.event_problems[:3])}"
             + (f" (+{len(run.event_problems) - 3} more)" if len(run.event_problems) > 3 else "")
             for run in runs if run.event_problems]
    return "; ".join(said)


# The detail the loading policy reads a known manifest from (checkpoint/trust.py: known_manifests); a program's own
# value of it is kept under REPORTED, never where it would make a folder known.
MANIFEST_DETAIL = "manifest_sha256"
REPORTED = "reported_manifest_sha256"


def unvouched(row: GateRow) -> GateRow:
    """A row the program reported, without a manifest digest of its own saying: the program's value stays on the row
    as what it reported, where no loader reads it (only :func:`admitted` puts a digest pilotrun computed back)."""
    if MANIFEST_DETAIL in row.details:
        details = dict(row.details)
        details[REPORTED] = details.pop(MANIFEST_DETAIL)
        row.details = details
    return row


def export_check(path: Any, reported: Any, root: Path) -> tuple[str | None, str]:
    """(the sha256 of the manifest pilotrun read once and checked every file of the folder against, "") or (None,
    why the export a row names is not one pilotrun vouches for): it must lie inside the run's checkpoint folder
    ``root`` and its manifest must be the one the row reported."""
    if not isinstance(path, str) or not path or not isinstance(reported, str):
        return None, "the row names no folder and manifest sha256"
    folder = Path(os.path.abspath(path))
    if not folder.is_relative_to(root) or folder == root:
        return None, f"it names {folder}, outside the run's checkpoint folder {root}"
    try:  # every file against the manifest, read once; its digest is that of those very bytes
        adm = LoadPolicy.of((), trust=True).admit(folder)
    except CheckpointError as exc:
        return None, str(exc)
    if adm.manifest_sha256 != reported:
        return None, (f"its manifest's sha256 is {adm.manifest_sha256[:12]}…, the row reported {reported[:12]}… "
                      "(the folder changed after the export)")
    return adm.manifest_sha256, ""


def admitted(row: GateRow, check: tuple[str | None, str]) -> None:
    """An export row as pilotrun's own check of its folder (:func:`export_check`) left it: the digest pilotrun
    computed, or a fail naming why there is none (a skip or fail the program reported is kept as it is)."""
    if row.verdict not in (Verdict.PASS, Verdict.WARN):
        return
    digest, problem = check
    if digest is not None:
        row.details = {**row.details, MANIFEST_DETAIL: digest}
        return
    row.verdict, row.failure = Verdict.FAIL, Failure.CHECK
    row.reason = f"pilotrun's own check of the export the program recorded failed: {problem} ({row.reason})"


def reload_stands(row: GateRow, checks: list[tuple[str | None, str]]) -> None:
    """A passing reload_eval row holds only where its rank's passing export rows passed pilotrun's own check too."""
    if row.verdict not in (Verdict.PASS, Verdict.WARN):
        return
    failed = [problem for digest, problem in checks if digest is None]
    if checks and not failed:
        return
    row.verdict, row.failure = Verdict.FAIL, Failure.CHECK
    why = failed[0] if failed else "the program recorded no passing export on this rank"
    row.reason = f"the export it reloaded did not pass pilotrun's own check: {why} ({row.reason})"


def reported(events: list[dict], gate: str | None = None) -> list[GateRow]:
    """The gate rows the program's ``stage`` or ``gate`` events carry (their shape was checked when the events were
    read: program.runner), of ``gate`` when given."""
    rows = [GateRow.from_mapping(e["row"]) for e in events]
    return [r for r in rows if gate is None or r.gate == gate]


def _not_on_program(gate: GateDeclaration, note: str | None = None) -> GateRow:
    return GateRow.now(gate.name, Verdict.SKIP, f"not measured on a program: {note or gate.program_note}",
                       details={"on_program": str(gate.on_program)})


def stage_rows(name: str, run: RunOutcome, enable: str, combines: bool = True) -> list[GateRow]:
    """One row per rank from the stages the run reported under ``name`` (several combined, or with ``combines``
    False the first kept); skip (or fail, when the run crashed before reporting it) where there is none."""
    name = str(name)  # the gate's name as the program wrote it (a GateName would quote as its repr)
    if not reported(run.of(Event.STAGE), name):
        if not run.ended_cleanly:
            return [GateRow.now(name, Verdict.FAIL, f"the {run.role} run {run.how_it_ended()} before reporting "
                                f"the {name!r} stage (log: {run.log})", failure=Failure.ERROR,
                                details={"log": str(run.log)})]
        return [GateRow.now(name, Verdict.SKIP, f"not measured: the program reported no {name!r} stage; {enable}",
                            details={"on_program": str(OnProgram.STAGE)})]
    out = []
    for rank in run.ranks:
        rows = reported(run.of(Event.STAGE, rank), name)
        if not rows:
            out.append(GateRow.now(name, Verdict.SKIP, f"not measured on rank {rank}: it reported no {name!r} stage "
                                   "(other ranks did)", rank=rank, world_size=run.world_size,
                                   details={"on_program": str(OnProgram.STAGE)}))
            continue
        if not combines or len(rows) == 1:
            row = rows[0]
            if len(rows) > 1:
                row.details = {**row.details, "note": f"{len(rows)} {name} stages reported; the first is kept"}
        else:
            row = combine(name, rows)
        row.rank = rank
        out.append(row)
    return out


def mark_problems(rows: list[GateRow], run: RunOutcome) -> None:
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


def combine(name: str, rows: list[GateRow]) -> GateRow:
    """Several stages of one name on one rank (steady_step per update, eval per evaluation): the worst verdict, the
    mean time of the stages after the first (what the job pays; the first is the one whose tensors were tracked,
    which slows it: the loop's steady_step leaves its tracked update out the same way; the median is kept beside
    it), each memory counter's largest value (counters stay apart)."""
    worst = min(rows, key=lambda r: r.verdict.severity)
    timed = rows[1:] if len(rows) > 1 else rows
    seconds = [r.seconds for r in timed if r.seconds is not None]
    memory: dict[str, Any] = {}
    for r in rows:
        for key, value in r.memory.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                memory[key] = max(value, memory.get(key, value))
            else:
                memory.setdefault(key, value)
    mean = statistics.fmean(seconds) if seconds else None
    reason = worst.reason if worst.verdict != Verdict.PASS else (
        f"{len(rows)} stages: mean {human_seconds(mean)} ({human_seconds(min(seconds))}–"
        f"{human_seconds(max(seconds))}); the largest peaks of them: {peaks_phrase(memory) or 'not measured'}"
        if mean is not None else f"{len(rows)} stages; time not measured")
    details = {k: v for k, v in worst.details.items() if k not in ("updates_timed", "update_seconds")}
    details.update(count=len(rows), seconds_each=[r.seconds for r in rows], timed_stages=len(timed),
                   **({"median_seconds": statistics.median(seconds)} if seconds else {}))
    if name == GateName.STEADY_STEP:
        details.update(_per_update(timed))
    return GateRow(name, worst.verdict, reason, inputs=rows[0].inputs, memory=memory, seconds=mean,
                   started_at=rows[0].started_at, ended_at=rows[-1].ended_at, details=details,
                   world_size=rows[0].world_size)


def _per_update(rows: list[GateRow]) -> dict:
    """Seconds per update over the timed steady_step stages, as the loop's row gives them: the mean over all their
    updates (SteadyStepDetails.seconds_per_update, which calibration reads) and the median of the stages'. A stage
    that counted no updates (one stage per update, the documented pattern) is one update."""
    timed = []
    for r in rows:
        d = r.details if isinstance(r.details, dict) else {}
        if d.get("seconds_per_update") is not None:
            timed.append((d["seconds_per_update"], int(d.get("updates_timed") or r.inputs.get("updates") or 1)))
        elif r.seconds is not None:
            timed.append((r.seconds, 1))
    if not timed:
        return {}
    updates = sum(n for _, n in timed)
    return {"seconds_per_update": sum(s * n for s, n in timed) / updates,
            "median_seconds_per_update": statistics.median(s for s, _ in timed), "updates_timed": updates}
