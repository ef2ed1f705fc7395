"""The resume comparison on a program's updates (pure logic): the first update and field that differ, and why."""
from __future__ import annotations

from pathlib import Path

from pilotrun.drivers import OnProgram
from pilotrun.gates.registry import BY_NAME, GATES
from pilotrun.ledger.records import Verdict
from pilotrun.program.compare import (
    CAUSE_TEXT,
    Basis,
    Cause,
    CompareChoice,
    CompareMode,
    Comparison,
    Difference,
    compare_updates,
    reproducibility,
    values_equal,
)
from pilotrun.program.env import Role, UpdateRecord
from pilotrun.program.resume import SavePoint, misnumbered, no_room_row, resume_rows, save_point, with_save_point
from pilotrun.program.runner import RunOutcome

EXACT = CompareChoice(CompareMode.BITWISE, 0.0, "program.compare: bitwise")


def _run(n, lr=lambda u: 0.1 / u, loss=lambda u: 1.0 / u, ids=lambda u: [2 * u, 2 * u + 1], start=1, **extra):
    return [UpdateRecord(u, ids(u), loss(u), lr(u), 0.5, dict(extra)) for u in range(start, n + 1)]


def test_equal_runs_pass_bitwise():
    diff = compare_updates(_run(4), _run(4, start=3), 3, 4, exact=True)
    assert diff.equal and diff.compared == [3, 4]


def test_lr_differs_names_the_scheduler():
    resumed = _run(4, start=3, lr=lambda u: 0.1 / (u - 2))  # a fresh scheduler
    diff = compare_updates(_run(4), resumed, 3, 4, exact=True)
    d = diff.difference
    assert (d.update, d.field, d.cause) == (3, "lr", Cause.SCHEDULER_NOT_RESTORED)
    assert "scheduler" in d.sentence() and "update 3" in d.sentence()


def test_ids_are_named_before_the_loss_they_moved():
    resumed = _run(4, start=3, ids=lambda u: [0, 1], loss=lambda u: 7.0)
    d = compare_updates(_run(4), resumed, 3, 4, exact=True).difference
    assert (d.field, d.cause) == ("ids", Cause.DATA_ORDER_NOT_RESTORED)


def test_loss_with_same_ids_is_state_saved_at_the_wrong_point_even_when_lr_moved_too():
    resumed = _run(4, start=3, loss=lambda u: 1.0 / u + 1e-9, lr=lambda u: 0.1 / (u - 1))
    d = compare_updates(_run(4), resumed, 3, 4, exact=True).difference
    assert (d.update, d.field, d.cause) == (3, "loss", Cause.STATE_SAVED_AT_WRONG_POINT)


def test_without_ids_the_first_differing_update_and_field_name_the_likely_cause():
    # Found piloting nanoGPT with the minimal handle: its resumed update re-trained update 1's batch, and the reason
    # said "same examples, different loss", a comparison that was never made (no ids reported). Then every cause was
    # listed even where the pattern points to one: update N+1 equal and N+2 different is the optimizer state.
    no_ids = lambda u: None  # noqa: E731
    control = _run(5, ids=no_ids)
    first = _first(compare_updates(control, _run(5, start=3, ids=no_ids, loss=lambda u: 7.0), 3, 5, exact=True))
    assert (first.update, first.field, first.cause, first.basis) == (3, "loss", Cause.DATA_ORDER_OR_RNG, Basis.PATTERN)
    text = first.sentence()
    assert "— likely: the first resumed update already differs: the data order was not restored" in text, text
    assert "RNG that dropout" in text and "same examples" not in text and "pass ids=[...]" in text
    later = _run(5, start=3, ids=no_ids, loss=lambda u: 1.0 / u if u == 3 else 7.0)  # N+1 equal, N+2 different
    d = _first(compare_updates(control, later, 3, 5, exact=True))
    assert (d.update, d.field, d.cause) == (4, "loss", Cause.OPTIMIZER_STATE_NOT_RESTORED) and d.likely
    assert "likely: the first resumed update matched and a later one differs" in d.sentence()
    assert "data order" not in d.sentence()
    lr = _first(compare_updates(control, _run(5, start=3, ids=no_ids, lr=lambda u: 0.5), 3, 5, exact=True))
    assert (lr.update, lr.cause) == (3, Cause.SCHEDULER_NOT_RESTORED) and "likely: the learning-rate" in lr.sentence()
    grad = _run(5, start=3, ids=no_ids)
    grad[0].grad_norm = 9.0
    g = _first(compare_updates(control, grad, 3, 5, exact=True))
    assert (g.update, g.cause) == (3, Cause.GRADIENT_STATE) and "likely: same loss" in g.sentence()
    # The update counter needs no ids: said as it is, not as "likely".
    step = _first(compare_updates(control, _run(2, ids=no_ids), 3, 5, exact=True))
    assert step.cause == Cause.STEP_NOT_RESTORED and "likely" not in step.sentence()
    # A program unseeded stays that, whatever the pattern.
    fresh = _first(reproducibility(control, _run(2, ids=no_ids, loss=lambda u: 7.0), 2, exact=True, rtol=0))
    assert fresh.cause == Cause.NOT_REPRODUCIBLE and "likely" not in fresh.sentence()


def test_with_ids_the_reasons_are_the_fields_own_not_likely():
    with_ids = _first(compare_updates(_run(4), _run(4, start=3, loss=lambda u: 7.0), 3, 4, exact=True))
    assert (with_ids.cause, with_ids.basis) == (Cause.STATE_SAVED_AT_WRONG_POINT, Basis.FIELDS)
    assert "likely" not in with_ids.sentence() and with_ids.sentence().endswith(CAUSE_TEXT[with_ids.cause])
    lr = _first(compare_updates(_run(4), _run(4, start=3, lr=lambda u: 0.5), 3, 4, exact=True))
    assert lr.cause == Cause.SCHEDULER_NOT_RESTORED and not lr.likely and "likely" not in lr.sentence()
    # Ids on one side only are not a comparison of the examples: the pattern's likely cause.
    one_side = compare_updates(_run(4), _run(4, start=3, ids=lambda u: None, loss=lambda u: 7.0), 3, 4, exact=True)
    assert one_side.cause == Cause.DATA_ORDER_OR_RNG and _first(one_side).likely


def _events(role, script, ids=True, tmp=Path("/nonexistent")):
    """A run's outcome on rank 0 from a script of ("u", n) updates and ("s", n) saves, in the order reported."""
    events = [{"kind": "start", "rank": 0, "world_size": 1}]
    for kind, n in script:
        if kind == "u":
            events.append({"kind": "update", "rank": 0, "update": n, "loss": 1.0 / n, "lr": 0.1, "grad_norm": 0.5,
                           "ids": [n] if ids else None, "extra": {}})
        else:
            events.append({"kind": "saved", "rank": 0, "update": n, "path": str(tmp / f"ck{n}.pt"), "asked": False})
    killed = role == Role.INTERRUPTED
    return RunOutcome(role, -9 if killed else 0, 0.1, tmp / f"{role}.log", events={0: events}, killed=killed,
                      killed_pids=[1] if killed else [])


def _first(diff: Comparison) -> Difference:
    assert diff.difference is not None, diff
    return diff.difference


def _auto_point(control: RunOutcome) -> SavePoint:
    point = save_point(control, "auto", 50)
    assert point is not None
    return point


def _updates(*numbers):
    return [("u", n) for n in numbers]


def test_the_resume_row_records_the_basis_and_the_fix_it_gives():
    control = _events(Role.CONTROL, [*_updates(1, 2), ("s", 2), *_updates(3, 4, 5)], ids=False)
    interrupted = _events(Role.INTERRUPTED, [*_updates(1, 2), ("s", 2)], ids=False)
    resumed = _events(Role.RESUMED, _updates(3, 4, 5), ids=False)
    resumed.events[0][-1]["loss"] = 7.0  # update 5 differs after an equal update 3 and 4
    (row,) = resume_rows({Role.CONTROL: control, Role.INTERRUPTED: interrupted, Role.RESUMED: resumed}, 2, 3, EXACT)
    assert row.verdict == Verdict.FAIL and "update 5: loss" in row.reason
    assert "likely: the first resumed update matched" in row.reason
    detail = row.details["difference"]
    assert (detail["cause"], detail["basis"]) == ("optimizer-state-not-restored", "pattern")
    assert detail["fix"].startswith("likely: ") and detail["fix"] in row.reason


def test_a_tolerance_comparison_is_said_whole_in_the_row():
    # compare_mode once returned prose that the row cut at its first ':', leaving "within rtol 1e-05 (program.compare"
    # in users' rows.
    control = _events(Role.CONTROL, [*_updates(1, 2), ("s", 2), *_updates(3, 4)])
    interrupted = _events(Role.INTERRUPTED, [*_updates(1, 2), ("s", 2)])
    resumed = _events(Role.RESUMED, _updates(3, 4))
    within = CompareChoice(CompareMode.RTOL, 1e-5, "program.compare: rtol")
    (row,) = resume_rows({Role.CONTROL: control, Role.INTERRUPTED: interrupted, Role.RESUMED: resumed}, 2, 2, within)
    assert row.verdict == Verdict.PASS and "equal the control's within rtol 1e-05 (ids, loss" in row.reason
    assert row.reason.count("(") == row.reason.count(")")
    assert row.details["compare"] == "within rtol 1e-05 (program.compare: rtol)"
    assert not within.exact and EXACT.exact and EXACT.how == "bitwise"


def test_a_save_numbered_unlike_the_update_before_it_is_found_on_its_rank():
    run = _events(Role.CONTROL, [("s", 0), *_updates(1, 2), ("s", 2), ("u", 3), ("s", 5), ("u", 4), ("s", 3)])
    assert [(m.rank, m.saved, m.after) for m in misnumbered(run)] == [(0, 5, 3), (0, 3, 4)]
    ahead, behind = misnumbered(run)
    assert "job.saved(5) was reported after job.update(3) on rank 0" in ahead.said()
    assert "job.saved(3, path)" in ahead.said() and "call job.update(5, ...) before job.saved(5)" in ahead.said()
    assert "job.saved(4, path)" in behind.said() and "before job.saved(3)" not in behind.said()
    assert misnumbered(_events(Role.CONTROL, [*_updates(1, 2), ("s", 2), ("u", 3)])) == []


def test_a_misnumbered_first_save_is_named_not_blamed_on_a_checkpoint_at_the_end_of_training():
    # Found: job.saved(8) after job.update(7) in a control that ended after update 9, and the row said "a checkpoint
    # at the end of training is not one a long run resumes from".
    control = _events(Role.CONTROL, [*_updates(*range(1, 8)), ("s", 8), *_updates(8, 9)])
    point = _auto_point(control)
    assert point.update == 8
    row = no_room_row(control, point, 2)
    assert row.verdict == Verdict.FAIL and "end of training" not in row.reason
    assert "job.saved(8) was reported after job.update(7) on rank 0: saved(N) must follow update(N)" in row.reason
    assert "after update 9" in row.reason and "the resume was not proven" in row.reason
    assert row.details["misnumbered_saves"] == [{"rank": 0, "saved": 8, "after_update": 7}]
    # A save numbered right keeps the schedule's reason.
    right = _events(Role.CONTROL, [*_updates(*range(1, 9)), ("s", 8), ("u", 9)])
    assert "A checkpoint at the end of training" in no_room_row(right, _auto_point(right), 2).reason


def test_a_resume_that_passes_warns_naming_both_numbers_of_a_misnumbered_save():
    control = _events(Role.CONTROL, [*_updates(1, 2), ("s", 2), *_updates(3, 4), ("s", 5), ("u", 5)])
    interrupted = _events(Role.INTERRUPTED, [*_updates(1, 2), ("s", 2)])
    resumed = _events(Role.RESUMED, _updates(3, 4))
    runs = {Role.CONTROL: control, Role.INTERRUPTED: interrupted, Role.RESUMED: resumed}
    point = _auto_point(control)
    (row,) = with_save_point(resume_rows(runs, 2, 2, EXACT, asked=False), point, control)
    assert row.verdict == Verdict.WARN and "updates 3–4 equal the control's" in row.reason
    assert "job.saved(5) was reported after job.update(4) on rank 0" in row.reason
    assert row.details["misnumbered_saves"] == [{"rank": 0, "saved": 5, "after_update": 4}]
    # The same runs numbered right pass.
    control.events[0][-2]["update"] = 4
    (row,) = with_save_point(resume_rows(runs, 2, 2, EXACT, asked=False), point, control)
    assert row.verdict == Verdict.PASS and "misnumbered_saves" not in row.details
    # A failing row stays a failure, and says the numbering too: saved(3) after update(2) kills the interrupted run
    # before it reports update 3.
    control = _events(Role.CONTROL, [*_updates(1, 2), ("s", 3), *_updates(3, 4, 5)])
    runs = {Role.CONTROL: control, Role.INTERRUPTED: _events(Role.INTERRUPTED, [*_updates(1, 2), ("s", 3)])}
    (row,) = with_save_point(resume_rows(runs, 3, 2, EXACT, asked=False),
                             _auto_point(control), control)
    assert row.verdict == Verdict.FAIL and "update 3: update (missing in interrupted)" in row.reason
    assert "job.saved(3) was reported after job.update(2) on rank 0" in row.reason


def test_differing_id_lists_are_shown_from_their_first_difference_with_the_count():
    # Found with 16 ids per update: the lists differed in their second micro batch and printed identically.
    control = _run(4, ids=lambda u: list(range(16 * u, 16 * u + 16)))
    resumed = _run(4, start=3, ids=lambda u: list(range(16 * u, 16 * u + 12)) + [0, 1, 2, 3])
    d = compare_updates(control, resumed, 3, 4, exact=True).difference
    assert (d.update, d.field) == (3, "ids")
    text = d.sentence()
    assert ("update 3: ids from position 12 (4 of 16 differ): […, 60, 61, 62, 63] (control) vs […, 0, 1, 2, 3] "
            "(resumed) — the data order was not restored") in text, text
    for record in control + resumed:  # an integration's dataset positions, where the items carry no id
        record.extra = {"ids_are": "dataset-position"}
    d = compare_updates(control, resumed, 3, 4, exact=True).difference
    assert d.sentence().startswith("update 3: dataset positions from position 12 (4 of 16 differ)"), d.sentence()


def test_bitwise_versus_tolerance():
    resumed = _run(4, start=3, loss=lambda u: 1.0 / u * (1 + 1e-6))
    assert not compare_updates(_run(4), resumed, 3, 4, exact=True).equal
    within = compare_updates(_run(4), resumed, 3, 4, exact=False, rtol=1e-3)
    assert within.equal and 0 < within.largest_rel < 1e-5
    assert not compare_updates(_run(4), resumed, 3, 4, exact=False, rtol=1e-9).equal
    assert values_equal(float("nan"), float("nan"), True, 0)[0] and not values_equal(1.0, float("inf"), False, 1)[0]


def test_step_counter_missing_updates_and_extra_fields():
    restarted = _run(2)  # the resumed run counted from 1 again
    diff = compare_updates(_run(4), restarted, 3, 4, exact=True)
    assert diff.cause == Cause.STEP_NOT_RESTORED and "job.resume_from" in diff.difference.sentence()
    short = _run(3, start=3)
    d = compare_updates(_run(4), short, 3, 4, exact=True).difference
    assert (d.update, d.cause) == (4, Cause.MISSING_UPDATES) and "resumed" in d.field
    d = compare_updates(_run(4, tokens=5.0), _run(4, start=3, tokens=6.0), 3, 4, exact=True).difference
    assert (d.field, d.cause) == ("extra.tokens", Cause.EXTRA_FIELD)


def test_fresh_runs_that_differ_are_not_reproducible():
    other = _run(2, ids=lambda u: [9, 8])
    d = reproducibility(_run(4), other, 2, exact=True, rtol=0).difference
    assert (d.update, d.field, d.cause, d.other_name) == (1, "ids", Cause.NOT_REPRODUCIBLE, "interrupted")


def test_every_gate_declares_how_it_runs_on_a_program():
    for gate in GATES:
        assert gate.program_note, gate.name
        if gate.on_program in (OnProgram.INTEGRATION, OnProgram.NEVER):  # a skip row must say what would enable it
            assert any(w in gate.program_note for w in ("integration", "give", "resume gate")), gate.name
    assert BY_NAME["resume"].on_program == OnProgram.RUNS and BY_NAME["eval"].on_program == OnProgram.STAGE
    assert BY_NAME["lock"].on_program == OnProgram.PILOT
    # the invalid values a program reported go on the update stages; first_step keeps its first stage only
    assert [g.name for g in GATES if g.program_problems] == ["first_step", "steady_step"]
    assert [g.name for g in GATES if not g.program_combines] == ["first_step"]


def test_loss_differing_only_after_an_equal_first_resumed_update_is_the_optimizer_state():
    # Found piloting a loop that did not save optimizer.state_dict(): update N+1 (loss computed before the first
    # resumed optimizer.step()) matched on every field; N+2 differed. Blaming "saved before optimizer.step()" there
    # sent the user to the wrong line.
    resumed = _run(5, start=3, loss=lambda u: 1.0 / u + (1e-3 if u >= 4 else 0.0))
    d = compare_updates(_run(5), resumed, 3, 5, exact=True).difference
    assert (d.update, d.field, d.cause) == (4, "loss", Cause.OPTIMIZER_STATE_NOT_RESTORED)
    assert "optimizer.state_dict()" in d.sentence()
    # at the first resumed update a loss difference still names the checkpoint's model state (or its dropout RNG)
    first = compare_updates(_run(5), _run(5, start=3, loss=lambda u: 2.0 / u), 3, 5, exact=True).difference
    assert (first.update, first.cause) == (3, Cause.STATE_SAVED_AT_WRONG_POINT) and "rng" in first.sentence().lower()


def test_a_loop_numbering_updates_from_zero_has_its_update_zero_compared():
    # Found piloting a loop that reports job.update(0, ...) first: its fresh runs were compared from update 1 only.
    def zero_based(n, bump=0.0):
        return _run(n, start=0, lr=lambda u: 0.1 / (u + 1), loss=lambda u: 1.0 / (u + 1) + (bump if u == 0 else 0.0))
    d = reproducibility(zero_based(4), zero_based(2, bump=1e-3), 2, exact=True, rtol=0).difference
    assert (d.update, d.field, d.cause) == (0, "loss", Cause.NOT_REPRODUCIBLE)
    assert reproducibility(zero_based(4), zero_based(2), 2, exact=True, rtol=0).equal


def test_a_loop_reporting_its_update_after_saving_it_is_told_the_order():
    # The interrupted run is killed inside job.saved(2): a loop calling job.update(2) after job.saved(2) never reports
    # update 2, and the row said "stopped early, crashed, or skips job.update".
    d = reproducibility(_run(4), _run(1), 2, exact=True, rtol=0).difference
    assert (d.update, d.cause) == (2, Cause.UPDATE_AFTER_SAVED)
    assert "job.update(N, ...) before job.saved(N)" in d.sentence()
    d = reproducibility(_run(4), _run(0), 2, exact=True, rtol=0).difference  # nothing reported at all: not that
    assert d.cause == Cause.MISSING_UPDATES
