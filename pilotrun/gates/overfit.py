"""``overfit``: a tiny subset is learned — loss below a threshold, every value finite, its own targets recovered.

A copy of the model trains on ``pilot.overfit.examples`` training examples with the
spec's optimizer (constant lr) in small batches whose order changes every pass, so
targets that depend on which examples share a batch (labels taken from a neighbour)
cannot be memorised. Targets are then checked one example at a time, in eval mode.
"""
from __future__ import annotations

import math

import torch

from ..drivers import Capability, NonFiniteError
from ..ledger.details import OverfitDetails
from ..ledger.records import Failure, GateName
from ..models.adapters import parameter_split
from ..train.batches import autocast_for, loss_of, to_device
from ..train.evaluation import accuracy_counts, shift_convention
from ..train.loss import window_backward
from ..train.optim import build_optimizer
from ..train.rng import derived_seed
from .base import Gate, GateFailure, Outcome, Product

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


def _own_targets(model, data, items, device, precision) -> tuple[float, float | None]:
    """Mean loss and accuracy of each example alone (its own targets, no neighbours)."""
    losses, correct, counted = [], 0, 0
    shift = shift_convention(model, data)
    model.eval()
    with torch.no_grad(), autocast_for(device, precision):
        for it in items:
            batch = to_device(data.collate([it]), device)
            out = model(**batch)
            losses.append(float(loss_of(out)))
            c, k = accuracy_counts(out, batch["labels"], shift)
            correct, counted = correct + c, counted + k
    model.train()
    return sum(losses) / len(losses), (correct / counted if counted else None)


def _update(model, opt, scaler, window, policy, spec, device, step: int) -> float:
    """One update of the copy on one small window; the loss, or NonFiniteError."""
    ids = window[0][0]
    stats = window_backward(model, window, policy, device, spec.train.precision, scaler)
    loss = float(stats["loss"])
    if not math.isfinite(loss):
        raise NonFiniteError("loss", step, loss, ids)
    if scaler is not None:
        scaler.unscale_(opt)
    norm = float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                                spec.train.max_grad_norm or float("inf")))
    if scaler is None and not math.isfinite(norm):
        raise NonFiniteError("gradient norm", step, norm, ids)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


class OverfitGate(Gate):
    name = GateName.OVERFIT
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
        spec, data, o, driver = ctx.spec, ctx.ensure_data(), ctx.spec.pilot.overfit, ctx.model_driver()
        policy = driver.policy
        order = driver.plan.order(0)
        subset = [data.train[i] for i in order[: o.examples]]
        ids = [str(it["id"]) for it in subset]
        model = driver.plain_model_copy()
        split = parameter_split(model)
        model.train()
        opt = build_optimizer(model, spec.train.optimizer)  # constant lr: the schedule belongs to the long run
        scaler = torch.amp.GradScaler(ctx.device.type) if spec.train.precision == "fp16" else None
        gen = torch.Generator().manual_seed(derived_seed(spec.seed + 7))
        losses: list[float] = []
        checks: list[dict] = []
        passed = False
        micro = min(o.micro_batch_size, len(subset))
        queue: list[int] = []
        out = Outcome(inputs=self.describe_inputs(ctx))
        start_loss, start_acc = _own_targets(model, data, subset, ctx.device, spec.train.precision)
        if not math.isfinite(start_loss):
            raise GateFailure(f"the subset's loss is {start_loss} before training (ids {', '.join(ids)})",
                              failure=Failure.NON_FINITE)
        threshold = o.loss_below if o.loss_below is not None else start_loss / 10
        checks.append({"update": 0, "loss": start_loss, "accuracy": start_acc})
        try:
            for step in range(1, o.max_updates + 1):
                if len(queue) < micro:
                    queue += torch.randperm(len(subset), generator=gen).tolist()
                take, queue = queue[:micro], queue[micro:]
                items = [subset[i] for i in take]
                window = [([ids[i] for i in take], data.collate(items))]
                losses.append(_update(model, opt, scaler, window, policy, spec, ctx.device, step))
                ctx.progress(step, o.max_updates, "overfit updates")
                if step % o.check_every == 0 or step == o.max_updates:
                    eval_loss, acc = _own_targets(model, data, subset, ctx.device, spec.train.precision)
                    checks.append({"update": step, "loss": eval_loss, "accuracy": acc})
                    if not math.isfinite(eval_loss):
                        raise GateFailure(f"the subset's loss is {eval_loss} at update {step}",
                                          failure=Failure.NON_FINITE)
                    if eval_loss < threshold and (acc is None or acc >= o.accuracy_at_least):
                        passed = True
                        break
            bad = next((n for n, p in model.named_parameters() if not torch.isfinite(p.detach()).all()), None)
            if bad is not None:
                raise GateFailure(f"parameter {bad!r} holds inf/NaN after overfitting", failure=Failure.NON_FINITE)
        finally:
            del model, opt
        last = checks[-1]
        out.details = OverfitDetails(
            memory_note="memory of this row includes the check's own model copy", losses=losses, checks=checks,
            ids=ids, updates=len(losses),
            thresholds={"loss_below": threshold, "accuracy_at_least": o.accuracy_at_least,
                        "loss_below_from": "pilot.overfit.loss_below" if o.loss_below is not None
                        else "a tenth of the starting loss"}).to_dict()
        acc_text = f", {last['accuracy']:.0%} of its own targets recovered" if last["accuracy"] is not None else ""
        if passed:
            out.reason = (f"{len(subset)} examples learned in {len(losses)} updates: loss {start_loss:.3g} -> "
                          f"{last['loss']:.3g} (< {threshold:.3g}){acc_text}")
            return out
        # model.hf is pretrained; model.config alone is a random init; a factory's model may be either.
        random_base = False if spec.model.hf else (True if spec.model.config is not None else None)
        shortfall = frozen_base_shortfall(start_loss, last["loss"], 1 - split.trainable_share, random_base)
        if shortfall:
            out.warn(f"{len(subset)} examples not learned in {len(losses)} updates: {shortfall}")
            return out
        needs = [f"loss {start_loss:.3g} -> {last['loss']:.3g} (needs < {threshold:.3g})"]
        if last["accuracy"] is not None:
            needs.append(f"{last['accuracy']:.0%} of targets recovered (needs {o.accuracy_at_least:.0%})")
        raise GateFailure(
            f"{len(subset)} examples not learned in {len(losses)} updates at lr {spec.train.optimizer.lr:g}: "
            + ", ".join(needs) + ". Usual causes: labels that do not belong to their inputs (shifted, taken from "
            "another example), inputs the model cannot see, or an lr too low to memorise a few examples (raise "
            "pilot.overfit.max_updates to tell)", inputs=out.inputs, details=out.details)
