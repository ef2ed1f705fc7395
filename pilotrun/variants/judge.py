"""A variant against its control, from what both runs measured (pure: numbers in, a verdict and its reason out).

Numerics are compared update by update on the same examples: the relative loss difference (max and at the last
update), the gradient-norm ratio, non-finite values, and for fp16 the scaler (updates it skipped, and that it
updated its scale exactly once per optimizer update, never per micro batch). Bitwise equality is not expected
across precisions: a bf16 matmul rounds differently from an fp32 one, and the difference grows over updates. The
quality check is the validation loss after the updates, within ``pilot.variants.val_loss_rtol`` of the control's.

Example::

    numerics = compare_updates(control_updates, variant_updates)
    verdict, reason = judge(variant, numerics, memory_ratio=0.62, time_ratio=1.31, val=(2.104, 2.101), rtol=0.02)
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

from ..ledger.records import Verdict


@dataclass
class UpdatePoint:
    """One update as a variant or the control ran it."""

    step: int
    loss: float
    grad_norm: float | None
    seconds: float
    ids: list
    scaler_skipped: bool = False
    scaler_updates: int | None = None   # calls to GradScaler.update in this update (fp16 only)


@dataclass
class Numerics:
    updates: int
    loss_rel_diff_max: float | None
    loss_rel_diff_last: float | None
    grad_norm_ratio_last: float | None
    grad_norm_ratio_range: tuple[float, float] | None
    non_finite: int                      # updates whose loss or gradient norm was inf/NaN (not skipped by a scaler)
    same_examples: bool                  # every update saw the control's sample ids
    scaler_skipped: int | None           # fp16: updates the scaler skipped
    scaler_once_per_update: bool | None  # fp16: its scale updated exactly once in every update

    def to_dict(self) -> dict:
        return asdict(self)


def share(x: float) -> str:
    """A relative difference for people: 0.19%, or 3.2e-05 where a percentage would read as zero."""
    return "0" if x == 0 else f"{x:.2%}" if x >= 1e-4 else f"{x:.1e}"


def rel_diff(a: float, b: float) -> float:
    """|a - b| / |b| (b at least 1e-12 in size): how far a variant's value is from the control's."""
    return abs(a - b) / max(abs(b), 1e-12)


def compare_updates(control: list[UpdatePoint], variant: list[UpdatePoint]) -> Numerics:
    """Update by update over the updates both ran."""
    pairs = list(zip(control, variant))
    finite = [(c, v) for c, v in pairs if math.isfinite(v.loss) and math.isfinite(c.loss)]
    diffs = [rel_diff(v.loss, c.loss) for c, v in finite]
    ratios = [v.grad_norm / c.grad_norm for c, v in pairs
              if v.grad_norm is not None and c.grad_norm and math.isfinite(v.grad_norm) and math.isfinite(c.grad_norm)]
    non_finite = sum(1 for v in variant if not v.scaler_skipped and (
        not math.isfinite(v.loss) or (v.grad_norm is not None and not math.isfinite(v.grad_norm))))
    scaled = [v for v in variant if v.scaler_updates is not None]
    last = pairs[-1] if pairs else None
    return Numerics(
        updates=len(pairs),
        loss_rel_diff_max=max(diffs) if diffs else None,
        loss_rel_diff_last=rel_diff(last[1].loss, last[0].loss) if last and (last[0], last[1]) in finite else None,
        grad_norm_ratio_last=ratios[-1] if ratios else None,
        grad_norm_ratio_range=(min(ratios), max(ratios)) if ratios else None,
        non_finite=non_finite,
        same_examples=all(c.ids == v.ids for c, v in pairs),
        scaler_skipped=sum(v.scaler_skipped for v in variant) if scaled else None,
        scaler_once_per_update=all(v.scaler_updates == 1 for v in scaled) if scaled else None,
    )


def time_ratio(control: list[UpdatePoint], variant: list[UpdatePoint], timed_from: int) -> float | None:
    """The median over interleaved rounds of (variant's seconds / control's) for the updates from ``timed_from``:
    each round ran both back to back, so a slow moment of the machine touches both sides of a ratio."""
    ratios = [v.seconds / c.seconds for c, v in zip(control, variant)
              if c.step >= timed_from and c.seconds > 0 and v.seconds > 0]
    return statistics.median(ratios) if ratios else None


@dataclass
class Judgement:
    verdict: Verdict
    reason: str
    experiment: str          # "same experiment" or "different experiment: <the keys>"


def judge(name: str, kind: str, numerics: Numerics, question: list[str], peak: int | None, control_peak: int | None,
          ratio: float | None, val: float | None, control_val: float | None, rtol: float,
          start: float | None = None, reference: str = "the control") -> Judgement:
    """The variant's verdict: fail when it went non-finite, its scaler stepped off the update boundary, or its
    validation loss is outside ``rtol`` of the control's; warn when it changes the question, saves no memory,
    its scaler skipped updates, its examples differed, or its validation loss is past half of ``rtol``; else
    pass. ``start``: the validation loss at the shared initial weights; where the control moved less than ``rtol``
    from it, the check cannot tell a variant that learned nothing, and the variant warns saying so. The reason
    claims only what was measured. ``reference``: what the control's side is, said in the reason (fp8 is read
    against the bf16 variant: "bf16")."""
    fails: list[str] = []
    warns: list[str] = []
    facts: list[str] = []
    experiment = "same experiment" if not question else "different experiment: changes " + ", ".join(question)
    if question:
        warns.append(f"a {experiment} (never a memory fix)")
    if peak is not None and control_peak:
        saved = control_peak - peak
        facts.append(f"peak {'-' if saved >= 0 else '+'}{abs(saved) / control_peak:.0%} of {reference}'s")
        if saved <= 0 and kind == "memory-fix":
            warns.append("it saves no memory here")
    if ratio is not None:
        facts.append(f"time x{ratio:.2f}")
    if numerics.loss_rel_diff_max is not None:
        facts.append(f"loss differs by up to {share(numerics.loss_rel_diff_max)} (update {numerics.updates}: "
                     f"{share(numerics.loss_rel_diff_last)})" if numerics.loss_rel_diff_last is not None
                     else f"loss differs by up to {share(numerics.loss_rel_diff_max)}")
    if numerics.non_finite:
        fails.append(f"{numerics.non_finite} update(s) with a non-finite loss or gradient norm")
    if not numerics.same_examples:
        warns.append(f"its updates did not see {reference}'s examples")
    if numerics.scaler_skipped:
        warns.append(f"the fp16 grad scaler skipped {numerics.scaler_skipped} of {numerics.updates} updates")
    if numerics.scaler_once_per_update is False:
        fails.append("the grad scaler's scale was not updated exactly once per optimizer update")
    elif numerics.scaler_once_per_update:
        facts.append("scaler updated once per update")
    if val is None or control_val is None or not math.isfinite(val):
        fails.append("no finite validation loss to compare" if val is None or not math.isfinite(val) else
                     f"{reference} has no validation loss")
    else:
        d = rel_diff(val, control_val)
        facts.append(f"val loss {val:.4g} vs {control_val:.4g} ({share(d)}, tolerance {rtol:.2%})")
        if d > rtol:
            fails.append(f"validation loss {d:.2%} from {reference}'s, beyond pilot.variants.val_loss_rtol {rtol:g}")
        elif d > rtol / 2:
            warns.append(f"validation loss {d:.2%} from {reference}'s, past half the tolerance")
        if start is not None and math.isfinite(start) and rel_diff(control_val, start) <= rtol:
            warns.append(f"{reference}'s validation loss moved only {share(rel_diff(control_val, start))} from "
                         f"{start:.4g} at the start, within the tolerance: this check cannot tell a variant that "
                         "learned nothing; run more updates (pilot.variants.updates)")
    verdict = Verdict.FAIL if fails else Verdict.WARN if warns else Verdict.PASS
    head = "; ".join(fails or warns)
    reason = f"{name}: " + (head + "; " if head else "") + ", ".join(facts)
    return Judgement(verdict, reason, experiment)
