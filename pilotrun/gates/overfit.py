"""``overfit``: a tiny subset is learned — loss below a threshold, every value finite, its own targets recovered.

Written once for every view (:mod:`pilotrun.gates.view`): a copy of the model trains on a few training examples in
small batches whose order changes every pass, so targets that depend on which examples share a batch (labels taken
from a neighbour) cannot be memorised; its targets are then scored one example at a time, in eval mode. pilotrun's
loop trains the copy with the spec's optimizer (constant lr) and ``pilot.overfit``'s budget and thresholds; a
framework's view with AdamW at a fixed lr on its own loss (the run's lr may be too low to memorise in a pilot's
budget). An adapter on a randomly initialised frozen base that learns but cannot memorise warns and says why.
"""
from __future__ import annotations

import math

import torch

from ..drivers import Capability
from ..ledger.details import OverfitDetails
from ..ledger.records import Failure, GateName
from ..models.adapters import parameter_split
from .base import NEEDS_INTEGRATION, Gate, GateFailure, OnProgram, Outcome, ProbeSite, Product
from .view import OverfitPlan, TrainingView

# An adapter on a frozen base learns only what the base's features allow. On a randomly initialised base (a model
# built from a config, as a pilot without the weights is) the logits stay near zero whatever the adapter does, so a
# few examples cannot be memorised however long it trains (examples/lora-sft/pilot.yaml measures it); a loss that
# falls is then all the gate can show. A loss that does not fall at all is still a failure: the adapter's gradients
# do not reach it.
ADAPTER_MIN_FALL = 0.02  # relative fall of the subset's loss that shows the adapter learns


def frozen_base_shortfall(start: float, last: float, frozen_share: float, random_base: bool | None) -> str | None:
    """Why not memorising a few examples is a ``warn``, not a ``fail``: an adapter on a frozen base whose loss fell
    but not below the threshold, on a base that is (``random_base`` True) or may be (None: the caller cannot tell)
    randomly initialised. None when the shortfall is a failure (full fine-tune, a loss that did not fall, a base
    known to be pretrained)."""
    if frozen_share <= 0 or random_base is False or not start > 0 or (start - last) / start < ADAPTER_MIN_FALL:
        return None
    base = ("the base is randomly initialised (built from a config), so its features cannot be fitted" if random_base
            else "if the base is randomly initialised (built from a config) its features cannot be fitted; on a "
                 "pretrained base this would be a failure")
    return (f"the adapter learns (loss {start:.3g} -> {last:.3g}, {(start - last) / start:.0%} lower) but did not "
            f"memorise the examples: {frozen_share:.1%} of the parameters are frozen and {base}. "
            "Pilot with the pretrained base to prove it")


def _train(view: TrainingView, model, plan: OverfitPlan, subset: list, threshold: float,
           checks: list[dict]) -> tuple[list[float], bool]:
    """Updates on the subset in reshuffled small batches until its targets are learned or the budget is spent."""
    updater = view.overfit_updater(model, plan)
    gen = torch.Generator().manual_seed(plan.seed)
    micro = min(plan.micro_batch_size, len(subset))
    queue: list[int] = []
    losses: list[float] = []
    for step in range(1, plan.max_updates + 1):
        if len(queue) < micro:
            queue += torch.randperm(len(subset), generator=gen).tolist()
        take, queue = queue[:micro], queue[micro:]
        losses.append(updater.update([subset[i] for i in take], step))
        view.progress(step, plan.max_updates, "overfit updates")
        if step % plan.check_every == 0 or step == plan.max_updates:
            eval_loss, acc = view.target_scores(model, subset)
            checks.append({"update": step, "loss": eval_loss, "accuracy": acc})
            if not math.isfinite(eval_loss):
                raise GateFailure(f"the subset's loss is {eval_loss} at update {step}", failure=Failure.NON_FINITE)
            if eval_loss < threshold and (plan.accuracy_at_least is None or acc is None
                                          or acc >= plan.accuracy_at_least):
                return losses, True
    return losses, False


def check_overfit(view: TrainingView, out: Outcome | None = None) -> Outcome:
    """The overfit check on any view; GateFailure when the subset is not learned."""
    out = out or Outcome()
    plan = view.overfit_plan()
    subset = view.overfit_items(plan.examples)
    # The items' own ids; where one has none, every example is named by its position instead (a framework's view
    # takes the training set's first examples; pilotrun's loop refuses an item without an id).
    own = all(isinstance(it, dict) and "id" in it for it in subset)
    ids = [str(it["id"]) if own else f"#{i}" for i, it in enumerate(subset)]
    named = f"ids {', '.join(ids)}" if own else f"dataset positions {', '.join(str(i) for i in range(len(subset)))}"
    model, _ = view.model_copy(None)
    split = parameter_split(model)
    model.train()
    start_loss, start_acc = view.target_scores(model, subset)
    if not math.isfinite(start_loss):
        raise GateFailure(f"the subset's loss is {start_loss} before training ({named})",
                          failure=Failure.NON_FINITE)
    threshold = plan.loss_below if plan.loss_below is not None else start_loss * plan.loss_fraction
    checks: list[dict] = [{"update": 0, "loss": start_loss, "accuracy": start_acc}]
    try:
        losses, passed = _train(view, model, plan, subset, threshold, checks)
        bad = next((n for n, p in model.named_parameters() if not torch.isfinite(p.detach()).all()), None)
        if bad is not None:
            raise GateFailure(f"parameter {bad!r} holds inf/NaN after overfitting", failure=Failure.NON_FINITE)
        random_base = view.random_base(model)
    finally:
        del model
    last = checks[-1]
    out.details = OverfitDetails(
        memory_note="memory of this row includes the check's own model copy", losses=losses, checks=checks, ids=ids,
        updates=len(losses), thresholds={"loss_below": threshold, "accuracy_at_least": plan.accuracy_at_least,
                                         "loss_below_from": plan.loss_below_from}, scored=view.scoring).to_dict()
    acc_text = f", {last['accuracy']:.0%} {plan.accuracy_means}" if last["accuracy"] is not None else ""
    scored = f"; scored {view.scoring}" if view.scoring else ""
    if passed:
        out.reason = (f"{len(subset)} examples learned in {len(losses)} updates: loss {start_loss:.3g} -> "
                      f"{last['loss']:.3g} (< {threshold:.3g}){acc_text}{scored}")
        return out
    shortfall = frozen_base_shortfall(start_loss, last["loss"], 1 - split.trainable_share, random_base)
    if shortfall:
        out.warn(f"{len(subset)} examples not learned in {len(losses)} updates: {shortfall}{scored}")
        return out
    needs = [f"loss {start_loss:.3g} -> {last['loss']:.3g} (needs < {threshold:.3g})"]
    if last["accuracy"] is not None and plan.accuracy_at_least is not None:
        needs.append(f"{last['accuracy']:.0%} {plan.accuracy_means} (needs {plan.accuracy_at_least:.0%})")
    raise GateFailure(
        f"{len(subset)} examples not learned in {len(losses)} updates at lr {plan.lr:g}: " + ", ".join(needs)
        + ". Usual causes: labels that do not belong to their inputs (shifted, taken from another example), inputs "
        f"the model cannot see, or an lr too low to memorise a few examples{plan.budget_hint}{scored}",
        inputs=out.inputs, details=out.details)


def probe(view: TrainingView, site: ProbeSite) -> Outcome:
    """The gate on a framework's view, in the program's process (``Gate.probe``)."""
    return check_overfit(view)


class OverfitGate(Gate):
    name = GateName.OVERFIT
    on_program = OnProgram.INTEGRATION
    probe = staticmethod(probe)
    program_note = NEEDS_INTEGRATION
    needs = (Product.DRIVER,)
    requires = (Capability.MODEL,)
    carry = True

    def track(self, ctx):
        return [ctx.model] if ctx.model is not None else []

    def describe_inputs(self, ctx) -> dict:
        o = ctx.spec.pilot.overfit
        return {**ctx.base_inputs(), "examples": o.examples, "micro_batch_size": o.micro_batch_size,
                "max_updates": o.max_updates, "lr": ctx.spec.train.optimizer.lr}

    def run(self, ctx, meter) -> Outcome:
        return check_overfit(ctx.view(), Outcome(inputs=self.describe_inputs(ctx)))
