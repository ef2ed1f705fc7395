"""The resume comparison: the updates two runs reported, field by field, and the first difference's cause.

The one comparison every driver's resume gate uses: pilotrun's loop (its worker's records through
:func:`loop_updates`), programs and the framework integrations (their event files, :mod:`pilotrun.program.env`).
Pure logic: no processes, no ledger.

For one rank, updates ``start..end`` of the control run and of the other run are compared in this order per
update — ids, loss, lr, grad_norm, then each extra field — and the first update that differs names its first
differing field, so a consequence is never reported before its cause: a loss moves when the ids do; the loss of
the first resumed update is computed from the restored model alone (the lr reported for it acts only on the
next one), so a loss difference there is the model state (or the dropout RNG), an lr difference with equal losses is
the scheduler, and a loss that differs only from the second resumed update on is the optimizer's state (the first
resumed optimizer.step() used it). Without ids the examples are not compared, so the same pattern names the
likely cause and the sentence says so (:class:`Basis`): the first resumed update's loss -> the data order or the RNG,
an equal first update and a later difference -> the optimizer state.

Example::

    diff = compare_updates(control, resumed, start=3, end=4, exact=True)
    diff.cause            # Cause.SCHEDULER_NOT_RESTORED
    diff.sentence()       # "update 3: lr 0.0008 (control) vs 0.001 (resumed) — the learning-rate scheduler ..."
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..ledger.records import TextEnum
from .env import IDS_ARE, IdKind, UpdateRecord


class CompareMode(TextEnum):
    """How a program's runs are compared (program.compare, or its automatic choice)."""

    BITWISE = "bitwise"   # every reported value equal to the bit
    RTOL = "rtol"         # equal within pilot.resume.rtol (relative)


@dataclass(frozen=True)
class CompareChoice:
    """How the resume gate compares a program's runs and why: the mode is what the code reads, ``why`` is said."""

    mode: CompareMode
    rtol: float
    why: str   # what chose it, e.g. "program.compare: rtol"

    @property
    def exact(self) -> bool:
        return self.mode is CompareMode.BITWISE

    @property
    def how(self) -> str:
        """The comparison in a row's words: "bitwise" or "within rtol 1e-05"."""
        return "bitwise" if self.exact else f"within rtol {self.rtol:g}"

    def text(self) -> str:
        """The row's ``compare`` detail: how, then why in brackets."""
        return f"{self.how} ({self.why})"


class Cause(TextEnum):
    """The usual reason for a difference (what the user fixes), by the field that differs first."""

    DATA_ORDER_NOT_RESTORED = "data-order-not-restored"  # ids: sampler/shuffle RNG or data position not restored
    SCHEDULER_NOT_RESTORED = "scheduler-not-restored"    # lr: scheduler state not saved or not loaded
    STATE_SAVED_AT_WRONG_POINT = "state-saved-at-wrong-point"  # loss with the same ids: model/optimizer state
    GRADIENT_STATE = "gradient-state"                    # grad_norm alone: e.g. gradients not zeroed / scaler state
    OPTIMIZER_STATE_NOT_RESTORED = "optimizer-state-not-restored"  # loss/grad_norm only after an equal first update
    EXTRA_FIELD = "extra-field"                          # a field the program added
    NOT_REPRODUCIBLE = "not-reproducible"                # two fresh runs differ before any resume (unseeded)
    MISSING_UPDATES = "missing-updates"                  # updates the comparison needs were not reported
    STEP_NOT_RESTORED = "step-not-restored"              # the resumed run numbered its updates from the start again
    UPDATE_AFTER_SAVED = "update-after-saved"            # job.update(N) after job.saved(N): killed before reporting
    OTHER_RANK = "other-rank"                            # grad_norm alone here, after another rank's ids/loss moved
    DATA_ORDER_OR_RNG = "data-order-or-rng"              # no ids: the first resumed update's loss already differs


class Basis(TextEnum):
    """What a difference's cause rests on: the fields compared, or (no ids) the pattern of which update differs."""

    FIELDS = "fields"    # the examples were compared (ids on both sides), or the cause needs no ids
    PATTERN = "pattern"  # no ids reported: the cause is read from the first update and field that differ — likely


# The causes a pattern names without ids: the sentence says "likely" (the examples were not compared).
LIKELY = frozenset({Cause.DATA_ORDER_OR_RNG, Cause.OPTIMIZER_STATE_NOT_RESTORED, Cause.SCHEDULER_NOT_RESTORED,
                    Cause.GRADIENT_STATE})
NO_IDS = ("; the program reported no ids, so the examples were not compared: pass ids=[...] of the update's "
          "examples to job.update to tell")


CAUSE_TEXT = {
    Cause.DATA_ORDER_NOT_RESTORED: "the data order was not restored: save and load the sampler/shuffle RNG (or seed it "
                                   "per epoch) and the position in the epoch",
    Cause.SCHEDULER_NOT_RESTORED: "the learning-rate scheduler was not saved or not restored "
                                  "(scheduler.state_dict() in the checkpoint, load_state_dict() on resume)",
    Cause.STATE_SAVED_AT_WRONG_POINT: "same examples, different loss: the model state in the checkpoint is not the "
                                      "state after the update it names (saved before optimizer.step(), not all of "
                                      "it restored, or kept outside state_dict: a buffer registered with "
                                      "persistent=False, a Python attribute), or the RNG that dropout/augmentation "
                                      "draws from was not "
                                      "saved and restored (torch.get_rng_state()/set_rng_state(), set after "
                                      "anything on resume that draws from it, such as iter(DataLoader))",
    Cause.GRADIENT_STATE: "same loss, different gradient norm: gradients not zeroed before the first resumed update, "
                          "or a grad scaler's state not restored",
    Cause.OPTIMIZER_STATE_NOT_RESTORED: "the first resumed update matched and a later one differs: the optimizer "
                                        "state (optimizer.state_dict(): Adam moments, step counts) or a grad "
                                        "scaler's was not saved or not restored, so the first resumed "
                                        "optimizer.step() moved the weights differently",
    Cause.EXTRA_FIELD: "a value the program reported with job.update(**extra) differs",
    Cause.NOT_REPRODUCIBLE: "two fresh runs differ before any resume: randomness the seed does not control (no "
                            "torch.manual_seed, an unseeded random.Random or numpy Generator, the sampler's "
                            "generator, DataLoader workers, nondeterministic kernels), so a resume cannot be compared",
    Cause.MISSING_UPDATES: "the run did not report these updates (it stopped early, crashed, or skips job.update)",
    Cause.STEP_NOT_RESTORED: "the resumed run did not continue after the checkpoint's update: the checkpoint was "
                             "not loaded (a program: job.resume_from ignored, or not found and training started "
                             "over) or the update counter was not restored from it; the first resumed update must "
                             "be N+1",
    Cause.UPDATE_AFTER_SAVED: "the interrupted run was killed inside job.saved(N), as planned, before it reported "
                              "update N: call job.update(N, ...) before job.saved(N)",
    Cause.OTHER_RANK: "same examples and loss on this rank, different gradient norm: the gradients are averaged "
                      "across ranks (DDP/FSDP), so this follows another rank's difference, not this rank's state",
    Cause.DATA_ORDER_OR_RNG: "the first resumed update already differs: the data order was not restored (the "
                             "sampler/shuffle RNG, the position in the epoch) or the RNG that dropout/augmentation "
                             "draws from was not (torch.get_rng_state()/set_rng_state(), set after anything on "
                             "resume that draws from it, such as iter(DataLoader)); less often the model state "
                             "in the checkpoint is not the state after the update it names",
}
# Said where one resumed update was compared: its loss and grad_norm come from the restored weights before any
# optimizer.step(), so a lost optimizer state shows only from the second one (found piloting a loop that saved no
# AdamW state: it passed with pilot.resume.after: 1).
ONE_UPDATE = ("the optimizer state was not checked: with one resumed update compared, a lost optimizer (or grad "
              "scaler) state cannot show; set pilot.resume.after: 2 or more")
# The order fields are compared in within one update (cause before consequence).
FIELDS = ("ids", "loss", "lr", "grad_norm")
FIELD_CAUSE = {"ids": Cause.DATA_ORDER_NOT_RESTORED, "lr": Cause.SCHEDULER_NOT_RESTORED,
               "loss": Cause.STATE_SAVED_AT_WRONG_POINT, "grad_norm": Cause.GRADIENT_STATE}


@dataclass
class Difference:
    update: int | None
    field: str
    control: Any
    other: Any
    cause: Cause
    other_name: str = "resumed"
    origin: str = ""  # the other rank this difference follows from (attribute_across_ranks), else empty
    ids_are: IdKind = IdKind.ITEM  # what the control's ids at this update are (an integration's dataset positions)
    basis: Basis = Basis.FIELDS

    def to_dict(self) -> dict:
        """The row's ``difference`` detail (every driver's resume row records the same)."""
        return {"update": self.update, "field": self.field, "control": self.control, "other": self.other,
                "run": self.other_name, "cause": str(self.cause), "fix": self.fix(), "basis": str(self.basis),
                **({"origin": self.origin} if self.origin else {}),
                **({"ids_are": str(self.ids_are)} if self.field == "ids" else {})}

    @property
    def likely(self) -> bool:
        """Whether the cause is the pattern's likely one (no ids compared), said as such."""
        return self.basis == Basis.PATTERN and self.cause in LIKELY

    def fix(self) -> str:
        """The cause's text, as the row's details and sentence give it."""
        return f"likely: {CAUSE_TEXT[self.cause]}{NO_IDS}" if self.likely else CAUSE_TEXT[self.cause]

    def sentence(self) -> str:
        where = f"update {self.update}" if self.update is not None else "updates"
        origin = f" ({self.origin})" if self.origin else ""
        if self.field == "ids" and isinstance(self.control, list) and isinstance(self.other, list):
            what, control, other = _show_ids(self.control, self.other, self.ids_are.label)
        else:
            what, control, other = self.field, _show(self.control), _show(self.other)
        return (f"{where}: {what} {control} (control) vs {other} ({self.other_name}) — "
                f"{self.fix()}{origin}")


@dataclass
class Comparison:
    compared: list[int] = field(default_factory=list)  # the updates found in both runs and compared
    difference: Difference | None = None
    largest_rel: float = 0.0  # the largest relative difference of loss/grad_norm accepted within rtol

    @property
    def equal(self) -> bool:
        return self.difference is None

    @property
    def cause(self) -> Cause | None:
        return None if self.difference is None else self.difference.cause


def _show(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(map(repr, value[:8]))}, … {len(value)} ids]"
    return repr(value)


def _show_ids(a: list, b: list, label: str = "ids", shown: int = 8) -> tuple[str, str, str]:
    """Two id lists from their first differing position (found with 16 ids per update: the first 8 were equal and
    the two lists printed alike), with how many differ: (what, control's, other's)."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    differing = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))

    def part(ids: list) -> str:
        cut = ids[first:first + shown]
        return f"[{'…, ' if first else ''}{', '.join(map(repr, cut))}{', …' if first + shown < len(ids) else ''}]"

    return f"{label} from position {first} ({differing} of {max(len(a), len(b))} differ):", part(a), part(b)


def values_equal(a: Any, b: Any, exact: bool, rtol: float) -> tuple[bool, float]:
    """(equal, relative difference) — floats bitwise when ``exact``, else within ``rtol``; anything else exactly."""
    if isinstance(a, float) and isinstance(b, float):
        if exact or not (math.isfinite(a) and math.isfinite(b)):
            return (a == b or (math.isnan(a) and math.isnan(b))), 0.0 if a == b else math.inf
        rel = abs(a - b) / max(abs(a), abs(b), 1e-12)
        return rel <= rtol, rel
    return a == b, 0.0 if a == b else math.inf


def _number(x: Any) -> Any:
    """A float the loop's worker wrote exactly (``float.hex()``, or ``repr`` of a non-finite one) as a float."""
    if isinstance(x, str):
        return float.fromhex(x) if x.lstrip("-").startswith("0x") else float(x)
    return x


def loop_updates(records: list[dict]) -> list[UpdateRecord]:
    """pilotrun's loop worker's records (``step``, ``sample_ids``, floats as hex) as the update records compared
    here: the same fields, so the loop's resume is judged as a program's is."""
    return [UpdateRecord(int(r["step"]), r.get("sample_ids"), _number(r.get("loss")), _number(r.get("lr")),
                         _number(r.get("grad_norm"))) for r in records]


def first_of(differences: Mapping[int, Difference]) -> tuple[int, Difference] | None:
    """(rank, difference) to name first among ranks: the earliest update, a rank's own cause before one that
    follows another rank's (:func:`attribute_across_ranks`), then the lowest rank."""
    if not differences:
        return None
    return min(differences.items(), key=lambda kv: (kv[1].update if kv[1].update is not None else -1,
                                                    kv[1].cause == Cause.OTHER_RANK, kv[0]))


def by_update(records: Sequence[UpdateRecord]) -> dict[int, UpdateRecord]:
    return {r.update: r for r in records}


def compare_updates(control: Sequence[UpdateRecord], other: Sequence[UpdateRecord], start: int, end: int,
                    exact: bool, rtol: float = 0.0, other_name: str = "resumed",
                    step_restored_check: bool = True) -> Comparison:
    """Updates ``start..end`` (inclusive) of ``other`` against ``control``; the first difference with its cause.

    ``lr`` is always compared exactly when ``exact``; off bitwise it is compared within ``rtol`` like the loss."""
    a, b = by_update(control), by_update(other)
    out = Comparison()
    if step_restored_check and b and start > 1 and min(b) < start:
        out.difference = Difference(min(b), "update", start, min(b), Cause.STEP_NOT_RESTORED, other_name)
        return out
    for n in range(start, end + 1):
        if n not in a or n not in b:
            missing = "control" if n not in a else other_name
            out.difference = Difference(n, "update", "reported" if n in a else "missing",
                                        "reported" if n in b else "missing", Cause.MISSING_UPDATES, other_name)
            out.difference.field = f"update (missing in {missing})"
            return out
        ra, rb = a[n], b[n]
        ids_compared = ra.ids is not None and rb.ids is not None
        for name in FIELDS:
            va, vb = ra.value(name), rb.value(name)
            if name == "ids" and not ids_compared:
                continue  # the program did not report ids: nothing to compare (the row says so)
            ok, rel = values_equal(va, vb, exact, rtol)
            if not ok:
                out.difference = Difference(n, name, va, vb, _cause(name, bool(out.compared), ids_compared),
                                            other_name, ids_are=IdKind.of(ra),
                                            basis=Basis.FIELDS if ids_compared else Basis.PATTERN)
                return out
            if math.isfinite(rel):
                out.largest_rel = max(out.largest_rel, rel)
        ea, eb = ra.extra, rb.extra
        # IDS_ARE says what the ids are (compared above), not a value of the update's own.
        for key in sorted((set(ea) | set(eb)) - {IDS_ARE}):
            ok, rel = values_equal(ea.get(key), eb.get(key), exact, rtol)
            if not ok:
                out.difference = Difference(n, f"extra.{key}", ea.get(key), eb.get(key), Cause.EXTRA_FIELD, other_name)
                return out
        out.compared.append(n)
    return out


def _cause(name: str, after_equal: bool, ids_compared: bool) -> Cause:
    """The cause of a difference in ``name`` (one of FIELDS); ``after_equal``: an earlier resumed update matched."""
    if name in ("loss", "grad_norm") and after_equal:
        # Every field of the first resumed update matched, so the restored weights, data and lr were right; what
        # moved the weights differently since is the optimizer's own state. Without ids only likely so (a later
        # batch was not compared), but a data order not restored shows from the first resumed update already.
        return Cause.OPTIMIZER_STATE_NOT_RESTORED
    if name == "loss" and not ids_compared:
        # "Same examples" would claim a comparison that was not made: another batch moves the loss too.
        return Cause.DATA_ORDER_OR_RNG
    return FIELD_CAUSE[name]


def reproducibility(control: Sequence[UpdateRecord], interrupted: Sequence[UpdateRecord], until: int, exact: bool,
                    rtol: float) -> Comparison:
    """Updates 1..until of two fresh runs (control and the interrupted run before its save) must agree; a
    difference there is the program's non-determinism, whatever the field, not a resume defect."""
    # A loop numbering its updates from 0 is consistent with itself (saved(N) then N+1 resumed); its update 0 is
    # compared too, not skipped.
    first = min([1, *(r.update for r in control)])
    diff = compare_updates(control, interrupted, first, until, exact, rtol, other_name="interrupted",
                           step_restored_check=False)
    d = diff.difference
    reported = by_update(interrupted)
    if d is not None and d.cause != Cause.MISSING_UPDATES:
        d.cause = Cause.NOT_REPRODUCIBLE
    elif d is not None and d.update == until and d.other == "missing" and reported and max(reported) < until:
        # Only the last update before the kill is missing: the loop saves before it reports (found piloting a loop
        # that logged at the end of its body); "stopped early, crashed, or skips job.update" did not say that.
        d.cause = Cause.UPDATE_AFTER_SAVED
    return diff


def attribute_across_ranks(differences: Mapping[int, Difference], silent: Sequence[int] = ()) -> None:
    """Point a rank's gradient-norm difference at the rank whose own data or loss differs first.

    ``differences``: each rank's first difference in one comparison (the same two runs). The gradient norm is
    taken after DDP/FSDP averaged every rank's gradients, so a rank whose ids and loss matched sees its grad_norm
    move when another rank's examples or loss (dropout RNG, a state only rank 0 restored) differ at that update or
    before: naming this rank's own gradient state (or optimizer) there sent the fix to the wrong rank (found
    piloting a DDP loop that restored rank 0's RNG on every rank). The cause becomes :attr:`Cause.OTHER_RANK`
    (fresh runs keep :attr:`Cause.NOT_REPRODUCIBLE`: the program is still unseeded) and ``origin`` names the rank.
    ``silent``: ranks that reported no updates (``job.update`` on rank 0 only); a grad_norm difference with no
    other rank behind it may come from them, and its ``origin`` says so.
    """
    upstream = {rank: d for rank, d in differences.items() if d.field in ("ids", "loss") and d.update is not None}
    for rank, diff in differences.items():
        if diff.field != "grad_norm" or diff.update is None:
            continue
        at = diff.update
        sources = sorted((d.update, r) for r, d in upstream.items()
                         if r != rank and d.update is not None and d.update <= at)
        if not sources:
            if silent:
                diff.origin = (f"or a difference on rank(s) {', '.join(map(str, silent))}, whose gradients are "
                               "averaged with this rank's but which report no updates: call job.update on every rank")
            continue
        source = upstream[sources[0][1]]
        if diff.cause != Cause.NOT_REPRODUCIBLE:
            diff.cause = Cause.OTHER_RANK
        diff.origin = f"rank {sources[0][1]} differs first: {source.field} at update {source.update}; see its row"
