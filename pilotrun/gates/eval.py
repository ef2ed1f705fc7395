"""``eval``: evaluation at the longest evaluation length and batch, then the metric on the val split.

The worst-case batch is the ``eval.batch_size`` longest validation examples,
padded to ``eval.max_length`` for built-in tasks: often the biggest peak of the
whole job (no optimizer state, but full-length activations and logits). The metric
pass never keeps logits on the device across batches.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..drivers import Capability
from ..ledger.records import Failure, GateName
from ..train.batches import autocast_for, item_length, labelled_batch, loss_of, seq_len, to_device
from ..train.compile import DynamoCounts, counts_since, dynamo_counts, outside_dispatch_modes, recompile_warning
from .base import Gate, GateFailure, OnProgram, Outcome, Product
from .steps import PAUSED

MAX_SCAN = 5000  # validation items scanned to find the longest ones


class EvalGate(Gate):
    name = GateName.EVAL
    on_program = OnProgram.STAGE
    program_note = "wrap the evaluation in `with job.stage(\"eval\"):`"
    needs = (Product.DRIVER,)
    requires = (Capability.MODEL,)
    job_memory = True
    carry = True
    shape_in_reason = True

    def describe_inputs(self, ctx) -> dict:
        inputs = ctx.base_inputs()
        inputs.pop("micro_batch_size", None)
        inputs.pop("grad_accum_steps", None)
        inputs["batch_size"] = ctx.spec.eval_batch_size
        inputs["seq_len"] = ctx.spec.eval_max_length
        return inputs

    def run(self, ctx, meter) -> Outcome:
        spec, data, driver = ctx.spec, ctx.ensure_data(), ctx.model_driver()
        model = driver.plain_model
        val = data.val
        bs = spec.eval_batch_size
        max_len = spec.eval_max_length
        inputs = self.describe_inputs(ctx)
        scan = min(len(val), MAX_SCAN)
        lengths = sorted(((item_length(val[i], data.collate), i) for i in range(scan)), reverse=True)
        worst_idx = [i for _, i in lengths[:bs]]
        collated = data.collate([val[i] for i in worst_idx])
        if (worst := labelled_batch(collated)) is None:
            keys = sorted(collated) if isinstance(collated, Mapping) else type(collated).__name__
            raise GateFailure(f"the collate returned no 'labels' for validation items (got {keys}); the contract "
                              "needs a dict of tensors including 'labels'")
        padded = False
        if data.pad_batch is not None and max_len:
            worst = data.pad_batch(worst, max_len)
            padded = True
        worst_len = seq_len(worst)
        inputs["seq_len"] = worst_len or None
        inputs["batch_size"] = len(worst_idx)
        inputs["padded_to_max_length"] = padded
        self.live_inputs = inputs
        compiled = getattr(driver, "compiled", None) is not None  # train.compile: what evaluating compiles
        before = dynamo_counts() if compiled else None
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), autocast_for(ctx.device, spec.train.precision), outside_dispatch_modes(compiled):
                out = model(**to_device(worst, ctx.device))
                worst_loss = float(loss_of(out)) if "labels" in worst else None
                del out
        finally:
            model.train(was_training)
        n_total = min(math.ceil(len(val) / bs), spec.eval.max_batches or math.inf)
        ctx.progress(0, n_total, "val batches")

        def check(index: int, items: list, loss: float) -> None:
            if not math.isfinite(loss):
                ids = [str(it["id"]) for it in items]
                raise GateFailure(f"eval loss is {loss} on validation batch {index + 1} (ids {', '.join(ids[:8])})",
                                  inputs=inputs, failure=Failure.NON_FINITE)
            ctx.progress(index + 1, n_total, "val batches")

        m = driver.evaluate(on_batch=check)
        eval_loss, accuracy, n_examples, n_batches = m["val_loss"], m["accuracy"], m["examples"], m["batches"]
        result = Outcome(inputs=inputs)
        kind = None if accuracy is None else ("next tokens" if data.task == "causal-lm"
                                              or worst.get("labels", torch.zeros(1)).ndim >= 2 else "classes")
        result.details = {"eval_loss": eval_loss, "accuracy": accuracy, "accuracy_of": kind,
                          "batches": n_batches, "examples": n_examples, "val_examples": len(val),
                          "worst_case_ids": [str(val[i]["id"]) for i in worst_idx], "worst_case_loss": worst_loss,
                          "scanned_for_longest": scan}
        acc = f", accuracy {accuracy:.1%}" if accuracy is not None else ""
        shape = f"{len(worst_idx)} x length {worst_len}" if worst_len else f"{len(worst_idx)} examples"
        result.reason = (f"peak batch: {shape}; val loss {eval_loss:.4g}{acc} "
                         f"over {n_examples} examples in {n_batches} batches")
        if max_len and worst_len and worst_len < max_len:
            result.warn(f"the longest validation batch has length {worst_len} < eval.max_length {max_len}: memory at "
                        f"{max_len} was not measured (the collate is yours: pad it to {max_len}, "
                        "or lower eval.max_length)")
        if before is not None:
            _eval_compile(result, counts_since(before), getattr(driver, "graphs_per_compile", None))
            if getattr(meter, "uses_tensor_tracker", False):
                result.details["compile"]["tensor_tracking"] = PAUSED
        if scan < len(val):
            result.details["note"] = f"longest examples searched among the first {scan} of {len(val)}"
        return result


def _eval_compile(result: Outcome, spent: DynamoCounts, per_compile: int | None) -> None:
    """train.compile: evaluation (eval mode, no grad, its own lengths) compiles graphs of its own. One shape's worth
    (as many graphs as the first update made) is the expected compile; more are recompiles for new lengths."""
    result.details["compile"] = spent.to_dict()
    result.reason = f"{result.reason}; compiled {spent.graphs} graph(s) for evaluation in {spent.seconds:.1f} s"
    extra = max(0, spent.graphs - (per_compile or 1))
    words = recompile_warning(DynamoCounts(spent.seconds, extra, spent.fell_back), "eval", timed=False)
    result.details["compile"]["recompiles"] = extra
    if words is not None:
        result.warn(words)
