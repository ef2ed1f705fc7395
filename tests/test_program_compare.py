"""The resume comparison on a program's updates (pure logic): the first update and field that differ, and why."""
from __future__ import annotations

from pilotrun.drivers import OnProgram
from pilotrun.gates.registry import BY_NAME, GATES
from pilotrun.program.compare import Cause, compare_updates, reproducibility, values_equal


def _run(n, lr=lambda u: 0.1 / u, loss=lambda u: 1.0 / u, ids=lambda u: [2 * u, 2 * u + 1], start=1, **extra):
    return [{"update": u, "loss": loss(u), "lr": lr(u), "grad_norm": 0.5, "ids": ids(u), "extra": extra}
            for u in range(start, n + 1)]


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


def test_a_loss_difference_without_ids_names_both_causes_not_the_same_examples():
    # Found piloting nanoGPT with the minimal handle: its resumed update re-trained update 1's batch, and the reason
    # said "same examples, different loss", a comparison that was never made (no ids reported).
    no_ids = lambda u: None  # noqa: E731
    resumed = _run(4, start=3, ids=no_ids, loss=lambda u: 7.0)
    d = compare_updates(_run(4, ids=no_ids), resumed, 3, 4, exact=True).difference
    assert (d.update, d.field, d.cause) == (3, "loss", Cause.DATA_OR_STATE)
    assert "same examples" not in d.sentence() and "data order" in d.sentence() and "model or optimizer" in d.sentence()
    later = _run(4, start=3, ids=no_ids, loss=lambda u: 1.0 / u if u == 3 else 7.0)  # first resumed update equal
    assert compare_updates(_run(4, ids=no_ids), later, 3, 4, exact=True).difference.cause == Cause.DATA_OR_STATE
    # With ids reported on both sides, the same loss difference is the state's.
    with_ids = compare_updates(_run(4), _run(4, start=3, loss=lambda u: 7.0), 3, 4, exact=True).difference
    assert with_ids.cause == Cause.STATE_SAVED_AT_WRONG_POINT


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
        record["extra"] = {"ids_are": "dataset-position"}
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
