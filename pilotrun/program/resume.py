"""The resume gate on a program: from the control, interrupted and resumed runs to one row per rank.

Updates 1..N of the control and the interrupted run must agree (two fresh runs; a difference there is the program's
non-determinism); updates N+1..N+K of the resumed run must equal the control's (:mod:`pilotrun.program.compare`).
Before any comparison: every value the runs reported must have been valid, the interrupted run must have been
killed after reporting ``saved(N)`` and the resumed run must have ended cleanly — each named with its fix.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..ledger.records import Failure, GateRow, TextEnum, Verdict
from .compare import (
    FIELDS,
    ONE_UPDATE,
    CompareChoice,
    Comparison,
    attribute_across_ranks,
    compare_updates,
    reproducibility,
)
from .env import IDS_ARE, Event, IdKind, Role, UpdateRecord
from .runner import RunOutcome

GATE = "resume"


class SaveKind(TextEnum):
    """Where the checkpoint the resume was proven from came from: the program's own, or one pilotrun asked for."""

    OWN = "own"                        # the program saved there without should_save asking (its own schedule)
    ASKED = "asked"                    # pilot.resume.before N: should_save asked for it
    ASKED_AT_LIMIT = "asked-at-limit"  # before: auto, and the program had saved nothing by auto_within


@dataclass(frozen=True)
class SavePoint:
    update: int
    kind: SaveKind
    own: tuple[int, ...]   # the updates the control run saved after on its own (rank 0)
    auto: bool             # pilot.resume.before: auto
    within: int            # pilot.resume.auto_within

    @property
    def asks(self) -> bool:
        """Whether the interrupted run is asked for this save (job.should_save): not at the program's own checkpoint
        that auto found, where it saves as the long run would."""
        return not (self.auto and self.kind == SaveKind.OWN)

    def to_dict(self) -> dict:
        return {"update": self.update, "kind": str(self.kind), "own_saves": list(self.own), "auto": self.auto}

    def said(self, control_updates: int) -> tuple[str, bool]:
        """(what the row adds, whether it warns)."""
        if self.kind == SaveKind.OWN:
            how = " (pilot.resume.before: auto)" if self.auto else ""
            return f"proven at the program's own checkpoint after update {self.update}{how}", False
        if self.kind == SaveKind.ASKED_AT_LIMIT:
            return (f"the program made no checkpoint of its own by update {self.within} (pilot.resume.auto_within), "
                    f"so pilotrun asked for one there: the long run never resumes from that point; let the program "
                    f"save within its first {self.within} updates (its save interval) to prove its own"), True
        others = [u for u in self.own if u != self.update]
        if others:
            return (f"the save after update {self.update} was one pilotrun asked for (pilot.resume.before "
                    f"{self.update}), while the program saves on its own after update(s) "
                    f"{', '.join(map(str, others[:5]))}: the long run resumes only from those; set "
                    "pilot.resume.before: auto to prove one of them"), True
        return (f"the save after update {self.update} was one pilotrun asked for (pilot.resume.before "
                f"{self.update}); the program made no checkpoint of its own in the control's {control_updates} "
                "updates to prove instead (pilot.resume.before: auto proves its first)"), False


def save_point(control: RunOutcome, before: int | str, within: int) -> SavePoint | None:
    """The checkpoint the interrupted run is killed after: with ``before: auto`` the control's first save (None
    when it made none), else ``before`` — the program's own when it saved there without should_save asking."""
    saves = control.of(Event.SAVED, 0)
    own = tuple(int(e["update"]) for e in saves if not e.get("asked"))
    if before == "auto":
        if not saves:
            return None
        first = saves[0]
        kind = SaveKind.ASKED_AT_LIMIT if first.get("asked") else SaveKind.OWN
        return SavePoint(int(first["update"]), kind, own, True, within)
    assert isinstance(before, int)
    return SavePoint(before, SaveKind.OWN if before in own else SaveKind.ASKED, own, False, within)


@dataclass(frozen=True)
class Misnumbered:
    """A save reported under another number than the update before it on its rank: ``saved(N)`` must follow
    ``update(N)``, the checkpoint holding the state after the update it names."""

    rank: int
    saved: int
    after: int  # the update the rank reported last before the save

    def said(self) -> str:
        # saved(N+1) after update(N) is either a save numbered one ahead or one made before its update was
        # reported: the events cannot tell which, so both fixes are named.
        ahead = (f", or, if it holds update {self.saved}'s state, call job.update({self.saved}, ...) before "
                 f"job.saved({self.saved})") if self.saved > self.after else ""
        return (f"job.saved({self.saved}) was reported after job.update({self.after}) on rank {self.rank}: saved(N) "
                f"must follow update(N) (the checkpoint holds the state after the update it names); number the save "
                f"by the last update reported, job.saved({self.after}, path){ahead}")

    def to_dict(self) -> dict:
        return {"rank": self.rank, "saved": self.saved, "after_update": self.after}


def misnumbered(run: RunOutcome) -> list[Misnumbered]:
    """Each save of ``run`` whose number is not the update its rank reported just before (a save before any update,
    such as the initial state, is not checked)."""
    out = []
    for rank in run.ranks:
        last: int | None = None
        for event in run.events.get(rank, []):
            if event.get("kind") == Event.UPDATE:
                last = int(event["update"])
            elif event.get("kind") == Event.SAVED and last is not None and int(event["update"]) != last:
                out.append(Misnumbered(rank, int(event["update"]), last))
    return out


def _last_update(control: RunOutcome) -> int:
    return max((u.update for r in control.ranks for u in control.updates(r)), default=0)


def no_own_save_row(control: RunOutcome, within: int) -> GateRow:
    """``before: auto`` and the control ended without any checkpoint."""
    last = _last_update(control)
    details = {"before": "auto", "auto_within": within, "logs": {str(control.role): str(control.log)}}
    if last >= within:
        return _fail(f"the control run {control.how_it_ended()} after update {last} without a checkpoint: it made "
                     f"none of its own, and none where pilotrun asked for one after update {within} "
                     f"(pilot.resume.auto_within; job.should_save({within}) was True there). Save where "
                     "job.should_save says as well as on the program's own schedule, and report each save with "
                     "job.saved(update, path)", details)
    return _fail(f"the control run {control.how_it_ended()} after update {last} without a checkpoint of its own, "
                 f"before update {within} (pilot.resume.auto_within) where pilotrun would have asked for one: a long "
                 "run of this program could not resume either. Let it save within its first updates (its save "
                 "interval, eval_interval or save_steps), or set pilot.resume.before: N to prove a save pilotrun "
                 "asks for (job.should_save)", details)


def no_room_row(control: RunOutcome, point: SavePoint, after: int) -> GateRow:
    """``before: auto`` and the program's first checkpoint leaves fewer than ``after`` updates to compare."""
    last = _last_update(control)
    wrong = next((m for m in misnumbered(control) if m.saved == point.update), None)
    if wrong is not None:
        # Counted from a save whose number is not its update's, "no room" and "a checkpoint at the end of training"
        # would blame the schedule for what the numbering did (found: job.saved(8) after job.update(7)).
        return _fail(f"the program's first checkpoint of its own: {wrong.said()}. Counted from update {point.update}, "
                     f"the control run, which {control.how_it_ended()} after update {last}, leaves fewer than the "
                     f"{after} updates the resume gate compares after it (pilot.resume.after), so the resume was not "
                     "proven", {"before": "auto", "save_point": point.to_dict(), "misnumbered_saves": [wrong.to_dict()],
                                "logs": {str(control.role): str(control.log)}})
    return _fail(f"the program's first checkpoint of its own is after update {point.update} and the control run "
                 f"{control.how_it_ended()} after update {last}: fewer than the {after} updates after it that the "
                 "resume gate compares (pilot.resume.after). A checkpoint at the end of training is not one a long run "
                 "resumes from; let the program save earlier in the pilot (its save interval below its length), or "
                 "set pilot.resume.before: N to prove a save pilotrun asks for",
                 {"before": "auto", "save_point": point.to_dict(), "logs": {str(control.role): str(control.log)}})


def with_save_point(rows: list[GateRow], point: SavePoint, control: RunOutcome) -> list[GateRow]:
    """Every row says which checkpoint the proof ran at; a passing one warns when it was not the program's own, and
    every row warns (a failing one says why too) when the control numbered a save unlike its update."""
    updates = max((len(control.updates(r)) for r in control.ranks), default=0)
    text, warns = point.said(updates)
    wrong = misnumbered(control)
    for row in rows:
        row.details = {**row.details, "save_point": point.to_dict()}
        if row.verdict in (Verdict.PASS, Verdict.WARN):
            row.reason = f"{row.reason}; {text}"
            if warns:
                row.verdict = Verdict.WARN
        if wrong:
            more = f" (and {len(wrong) - 1} more save(s) so numbered; see details)" if len(wrong) > 1 else ""
            row.reason = f"{row.reason}; {wrong[0].said()}{more}"
            row.details["misnumbered_saves"] = [m.to_dict() for m in wrong]
            if row.verdict == Verdict.PASS:
                row.verdict = Verdict.WARN
    return rows


def _fail(reason: str, details: dict, failure: Failure = Failure.CHECK, rank: int = 0) -> GateRow:
    return GateRow.now(GATE, Verdict.FAIL, reason, details=details, failure=failure, rank=rank)


def resume_rows(runs: dict[Role, RunOutcome], before: int, after: int, compare: CompareChoice,
                asked: bool = True) -> list[GateRow]:
    """``asked``: the save after ``before`` was one pilotrun asked for (False: the program's own checkpoint)."""
    details: dict = {"before": before, "after": after, "compare": compare.text(),
                     "logs": {str(role): str(run.log) for role, run in runs.items()},
                     "seconds": {str(role): round(run.seconds, 3) for role, run in runs.items()}}
    refused = _not_comparable(runs, before, after, details, asked)
    return refused if refused is not None else _compared(runs, before, after, compare, details)


# The exceptions of a load that found no file, or a file cut short: what a save reported before its write completed
# leaves behind (torch.load's zip reader raises RuntimeError "PytorchStreamReader failed reading zip archive").
INCOMPLETE_CHECKPOINT = frozenset({"FileNotFoundError", "EOFError", "NotADirectoryError", "BadZipFile"})


def _not_comparable(runs: dict[Role, RunOutcome], before: int, after: int, details: dict,
                    asked: bool = True) -> list[GateRow] | None:
    """The row when the runs cannot be compared (invalid values, a control run that failed or ended early, an
    interrupted run that was not killed after its save); None when they can."""
    control, interrupted = runs[Role.CONTROL], runs.get(Role.INTERRUPTED)
    end = before + after
    problems = [(role, e) for role, run in runs.items() for e in run.of(Event.PROBLEM)]
    if problems:
        details["problems"] = [{"run": str(role), **{k: e.get(k) for k in ("rank", "update", "field", "problem")}}
                               for role, e in problems]
        role, first = problems[0]
        where = f"update {first['update']}" if first.get("update") is not None else "a call"
        more = f" (and {len(problems) - 1} more; see details)" if len(problems) > 1 else ""
        return [_fail(f"the {role} run reported an invalid value at {where} on rank {first.get('rank', 0)}: "
                      f"{first['problem']}{more}", details,
                      Failure.NON_FINITE if any(e.get("non_finite") for _, e in problems) else Failure.CHECK)]
    skipped = "; the interrupted and resumed runs were not started" if interrupted is None else ""
    if not control.ended_cleanly:
        return [_fail(f"the control run {control.how_it_ended()} (log: {control.log}){skipped}", details,
                      Failure.ERROR)]
    if not any(control.updates(r) for r in control.ranks):
        return [_fail(f"the control run reported no updates{skipped}: call job.update(update, loss=..., lr=...) "
                      "after each optimizer.step()", details)]
    short = short_of(control, end)
    if short is not None:
        rank, last = short
        return [_fail(f"the control run {control.how_it_ended()} after update {last} (rank {rank}), but the resume "
                      f"gate compares updates up to {end} (pilot.resume.before {before} + after {after}){skipped}: "
                      f"let the program run at least {end} updates (its max_steps, epochs or --updates), or lower "
                      "pilot.resume.before/after", details)]
    assert interrupted is not None
    if not interrupted.killed:
        saved = [e["update"] for e in interrupted.of(Event.SAVED)]
        said = f"reported saves after {saved}" if saved else "never called job.saved(update, path)"
        where = (f"pilotrun asks for a save after update {before} (job.should_save({before}) is True there)" if asked
                 else f"the control run saved on its own after update {before}, and the interrupted run, the same "
                      "program, is killed once it reports that save")
        return [_fail(f"the interrupted run {interrupted.how_it_ended()} and {said}; {where}: save then call "
                      f"job.saved({before}, path) on rank 0", details, Failure.ERROR)]
    if interrupted.survivors:
        return [_fail(f"the interrupted run {interrupted.how_it_ended()}; the resumed run was not started beside "
                      "them", details, Failure.ERROR)]
    return None


def _compared(runs: dict[Role, RunOutcome], before: int, after: int, compare: CompareChoice,
              details: dict) -> list[GateRow]:
    """Updates 1..N of the two fresh runs, then N+1..N+K of the resumed run against the control, per rank."""
    control, interrupted, resumed = runs[Role.CONTROL], runs[Role.INTERRUPTED], runs.get(Role.RESUMED)
    end = before + after
    checkpoint = interrupted.of(Event.SAVED, 0)[-1]["path"]
    details.update(checkpoint=checkpoint, killed_pids=interrupted.killed_pids, killed_after_update=before)
    ranks = [r for r in control.ranks if control.updates(r)]
    # Ranks that started (their handle wrote its start event) but reported no update: a loop calling job.update on
    # rank 0 only. Their resume cannot be compared; every row says so rather than passing for all ranks.
    silent = [r for r in control.ranks if not control.updates(r)]
    exact, rtol = compare.exact, compare.rtol
    fresh = {rank: reproducibility(control.updates(rank), interrupted.updates(rank), before, exact, rtol)
             for rank in ranks}
    after_resume: dict[int, Comparison] = {}
    if resumed is not None and resumed.ended_cleanly:
        after_resume = {rank: compare_updates(control.updates(rank), resumed.updates(rank), before + 1, end, exact,
                                              rtol) for rank in ranks if fresh[rank].equal}
    # Within one comparison, a rank's grad_norm difference may follow another rank's (gradients are all-reduced).
    for comparisons in ({r: c for r, c in fresh.items() if not c.equal}, after_resume):
        attribute_across_ranks({r: c.difference for r, c in comparisons.items() if c.difference is not None}, silent)
    rows = []
    for rank in ranks:
        if not fresh[rank].equal:  # nothing after a resume can be compared (the resumed run is not started)
            rows.append(_row(rank, fresh[rank], False, before, end, checkpoint, compare, dict(details)))
        elif rank not in after_resume:
            how = resumed.how_it_ended() if resumed is not None else "was not started"
            hint = ""
            if (resumed is not None and not resumed.timed_out and not any(resumed.updates(r) for r in resumed.ranks)
                    and resumed.raised() in INCOMPLETE_CHECKPOINT):
                # Found piloting a loop that called job.saved before writing the file: the resumed run's
                # FileNotFoundError was quoted without saying what it means for the program. Said only where the
                # failure is a missing or short file (a checkpoint the program cannot unpickle is another fault).
                hint = ("; it failed before its first update, so it could not load the checkpoint the interrupted "
                        "run reported: call job.saved only once the write is complete (the process is killed "
                        "there), and load what the save wrote")
            rows.append(_fail(f"the resumed run (from {checkpoint}) {how}{hint}", dict(details), Failure.ERROR,
                              rank))
        else:
            rows.append(_row(rank, after_resume[rank], True, before, end, checkpoint, compare, dict(details),
                             reported=reported_fields(control.updates(rank)), ids_are=ids_kind(control.updates(rank))))
    for row in rows:
        row.world_size = control.world_size  # a rank's row says of how many (found: "rank 1 of 1" on 2 ranks)
        if silent and row.verdict == Verdict.PASS:
            row.verdict = Verdict.WARN
            row.reason = (f"{row.reason}; rank(s) {', '.join(map(str, silent))} reported no updates, so their resume "
                          "was not compared: call job.update on every rank, each with its own ids")
        if silent:
            row.details = {**row.details, "ranks_without_updates": silent}
    return rows


def short_of(control: RunOutcome, end: int) -> tuple[int, int] | None:
    """(rank, last update) of the first rank whose control run ended before update ``end`` (the program's own
    step count is below pilot.resume.before + after), else None: nothing after it can be compared."""
    for rank in control.ranks:
        updates = [u.update for u in control.updates(rank)]
        if updates and max(updates) < end:
            return rank, max(updates)
    return None


def reported_fields(updates: Sequence[UpdateRecord]) -> list[str]:
    """The fields the program reported a value for (the row names only what was really compared)."""
    out = [name for name in FIELDS if any(u.value(name) is not None for u in updates)]
    extra = sorted({key for u in updates for key in u.extra} - {IDS_ARE})
    return out + [f"extra.{key}" for key in extra]


def ids_kind(updates: Sequence[UpdateRecord]) -> IdKind:
    """What the ids the program reported are: the items' own, or (an integration's) their dataset positions."""
    kinds = {IdKind.of(u) for u in updates if u.ids is not None}
    return next(iter(kinds)) if len(kinds) == 1 else IdKind.MIXED if kinds else IdKind.ITEM


def fresh_runs_agree(control: RunOutcome, interrupted: RunOutcome, before: int, exact: bool, rtol: float) -> bool:
    """Whether updates 1..N of the two fresh runs agree on every rank (else a resume cannot be judged)."""
    return all(reproducibility(control.updates(r), interrupted.updates(r), before, exact, rtol).equal
               for r in control.ranks if control.updates(r))


def _row(rank: int, diff: Comparison, reproducible: bool, before: int, end: int, checkpoint: str,
         compare: CompareChoice, details: dict, reported: list[str] | None = None,
         ids_are: IdKind = IdKind.ITEM) -> GateRow:
    details["compared_updates"] = diff.compared
    if diff.difference is not None:
        d = diff.difference
        details["difference"] = d.to_dict()
        stage = "before the save (fresh runs)" if not reproducible else "after the resume"
        return _fail(f"rank {rank}, {stage}: {d.sentence()}", details, rank=rank)
    details["largest_relative_difference"] = diff.largest_rel
    span = f"updates {before + 1}–{end}" if end > before + 1 else f"update {end}"
    how = compare.how
    killed = len(details.get("killed_pids") or [])
    fields = list(FIELDS) if reported is None else reported
    details["compared_fields"] = fields
    if "ids" in fields:
        details["ids_are"] = str(ids_are)
    # The items carry no id where an integration reported their dataset positions: say what was compared.
    named = [ids_are.label if f == "ids" else f for f in fields]
    reason = (f"{span} equal the control's {how} ({', '.join(named) or 'no field reported'}) after SIGKILL of the "
              f"interrupted run ({killed} process(es)) at update {before} and a resume from {Path(checkpoint).name}")
    row = GateRow.now(GATE, Verdict.PASS, reason, details=details, rank=rank)
    if "ids" not in fields:
        row.verdict = Verdict.WARN
        row.reason = (f"{reason}; the data order was not compared: the program reports no ids (pass "
                      "ids=[...] of the update's examples to job.update)")
    if len(diff.compared) < 2:
        # The first resumed update's loss and grad_norm come from the restored weights before any optimizer.step();
        # a lost optimizer state shows only from the second one (found piloting a loop that saved no AdamW state:
        # it passed with pilot.resume.after: 1).
        row.verdict = Verdict.WARN
        row.reason = f"{row.reason}; {ONE_UPDATE}"
    return row
