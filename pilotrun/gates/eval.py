"""``eval``: evaluation at the longest evaluation length and batch, then the metric on the val split.

The worst-case batch is the ``eval.batch_size`` longest validation examples,
padded to ``eval.max_length`` for built-in tasks: often the biggest peak of the
whole job (no optimizer state, but full-length activations and logits). The metric
pass never keeps logits on the device across batches.
"""
from __future__ import annotations

import math

import torch

from ..train.loop import _loss_of, _seq_dim, autocast_for, to_device, token_accuracy
from .overfit import shift_convention
from .base import Gate, GateFailure, Outcome

MAX_SCAN = 5000  # validation items scanned to find the longest ones


def _item_length(item, collate) -> int:
    """Sequence length of one item (0 for inputs without a sequence, e.g. images)."""
    ids = item.get("input_ids") if isinstance(item, dict) else None
    if isinstance(ids, (list, tuple)) or (isinstance(ids, torch.Tensor) and ids.ndim == 1):
        return len(ids)
    return _seq_dim(collate([item]))


def _metrics_of(out, batch, shift: bool | None) -> tuple[int, int]:
    """(correct, counted) for accuracy: class accuracy, or next-token accuracy on supervised positions."""
    logits = getattr(out, "logits", None) if not isinstance(out, dict) else out.get("logits")
    labels = batch.get("labels")
    if logits is None or labels is None:
        return 0, 0
    if labels.is_floating_point():
        return 0, 0  # regression: no accuracy
    if labels.ndim == 1 and logits.ndim == 2:
        return int((logits.argmax(-1) == labels).sum()), labels.numel()
    if labels.ndim == 2 and logits.ndim == 3 and logits.shape[:2] == labels.shape:
        correct, counted, _ = token_accuracy(logits, labels, shift)
        return correct, counted
    return 0, 0


def val_metrics(model, data, spec, device, on_batch=None) -> dict:
    """Loss and accuracy over the validation split (its first ``eval.max_batches`` batches when set).

    The one metric pass of pilotrun: the eval gate and every campaign validation point use it.
    ``on_batch(index, items, loss)`` sees each batch's loss before it is counted (the gate stops
    at a non-finite one and reports progress). The model is left in the mode it came in.
    """
    bs = spec.eval_batch_size
    total_loss = 0.0
    n_batches = n_examples = correct = counted = 0
    limit = spec.eval.max_batches or math.inf
    val = data.val
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast_for(device, spec.train.precision):
            for start in range(0, len(val), bs):
                if n_batches >= limit:
                    break
                items = [val[i] for i in range(start, min(len(val), start + bs))]
                batch = to_device(data.collate(items), device)
                out = model(**batch)
                loss = float(_loss_of(out))
                if on_batch is not None:
                    on_batch(n_batches, items, loss)
                c, k = _metrics_of(out, batch, shift_convention(model, data))
                correct, counted = correct + c, counted + k
                total_loss += loss * len(items)
                n_examples += len(items)
                n_batches += 1
                del out, batch
    finally:
        model.train(was_training)
    return {"val_loss": total_loss / max(n_examples, 1), "accuracy": correct / counted if counted else None,
            "examples": n_examples, "batches": n_batches}


class EvalGate(Gate):
    name = "eval"
    depends_on = ("load",)
    shape_in_reason = True

    def describe_inputs(self, ctx) -> dict:
        inputs = ctx.base_inputs()
        inputs.pop("micro_batch_size", None)
        inputs.pop("grad_accum_steps", None)
        inputs["batch_size"] = ctx.spec.eval_batch_size
        inputs["seq_len"] = ctx.spec.eval_max_length
        return inputs

    def run(self, ctx, meter) -> Outcome:
        spec, data, model = ctx.spec, ctx.data, ctx.model
        val = data.val
        bs = spec.eval_batch_size
        max_len = spec.eval_max_length
        inputs = self.describe_inputs(ctx)
        scan = min(len(val), MAX_SCAN)
        lengths = sorted(((_item_length(val[i], data.collate), i) for i in range(scan)), reverse=True)
        worst_idx = [i for _, i in lengths[:bs]]
        worst = data.collate([val[i] for i in worst_idx])
        if not isinstance(worst, dict) or "labels" not in worst:
            keys = sorted(worst) if isinstance(worst, dict) else type(worst).__name__
            raise GateFailure(f"the collate returned no 'labels' for validation items (got {keys}); the contract "
                              "needs a dict of tensors including 'labels'")
        padded = False
        if data.pad_batch is not None and max_len:
            worst = data.pad_batch(worst, max_len)
            padded = True
        worst_len = _seq_dim(worst)
        inputs["seq_len"] = worst_len or None
        inputs["batch_size"] = len(worst_idx)
        inputs["padded_to_max_length"] = padded
        self.live_inputs = inputs
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), autocast_for(ctx.device, spec.train.precision):
                out = model(**to_device(worst, ctx.device))
                worst_loss = float(_loss_of(out)) if "labels" in worst else None
                del out
        finally:
            model.train(was_training)
        n_total = min(math.ceil(len(val) / bs), spec.eval.max_batches or math.inf)
        ctx.progress(0, n_total, "val batches")

        def check(index: int, items: list, loss: float) -> None:
            if not math.isfinite(loss):
                ids = [str(it["id"]) for it in items]
                raise GateFailure(f"eval loss is {loss} on validation batch {index + 1} (ids {', '.join(ids[:8])})",
                                  inputs=inputs)
            ctx.progress(index + 1, n_total, "val batches")

        m = val_metrics(model, data, spec, ctx.device, on_batch=check)
        eval_loss, accuracy, n_examples, n_batches = m["val_loss"], m["accuracy"], m["examples"], m["batches"]
        result = Outcome(inputs=inputs)
        kind = None if accuracy is None else ("next tokens" if data.task == "causal-lm" or worst.get("labels", torch.zeros(1)).ndim >= 2 else "classes")
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
                        f"{max_len} was not measured (the collate is yours: pad it to {max_len}, or lower eval.max_length)")
        if scan < len(val):
            result.details["note"] = f"longest examples searched among the first {scan} of {len(val)}"
        return result
