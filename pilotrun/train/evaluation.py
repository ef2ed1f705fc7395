"""Evaluation: the metric pass over the validation split, accuracy from logits, and outputs for comparison.

One implementation of each: the eval gate, the overfit gate, campaign validation points, the
reload worker and archived control sets all use these.
"""
from __future__ import annotations

import math

import torch

from .batches import IGNORE, autocast_for, logits_of, loss_of, to_device


def token_accuracy(logits: torch.Tensor, labels: torch.Tensor, shift: bool | None) -> tuple[int, int, bool]:
    """(correct, counted, shifted) over supervised positions. ``shift=None`` when the model's convention
    is unknown (a user's own LM): both alignments are scored and the better one is kept."""
    def score(s: bool) -> tuple[int, int]:
        pred = (logits[:, :-1] if s else logits).argmax(-1)
        tgt = labels[:, 1:] if s else labels
        mask = tgt != IGNORE
        return int(((pred == tgt) & mask).sum()), int(mask.sum())

    if shift is not None:
        return (*score(shift), shift)
    a, b = score(True), score(False)
    return (*a, True) if a[0] >= b[0] else (*b, False)


def accuracy_counts(out, labels: torch.Tensor | None, shift: bool | None) -> tuple[int, int]:
    """(correct, counted) from a forward's logits: class accuracy for one label per example, next-token
    accuracy on supervised positions for a label per token, nothing for regression targets."""
    logits = logits_of(out)
    if logits is None or not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        return 0, 0
    if labels.ndim == 1 and logits.ndim == 2:
        return int((logits.argmax(-1) == labels).sum()), labels.numel()
    if labels.ndim == 2 and logits.ndim == 3 and logits.shape[:2] == labels.shape:
        correct, counted, _ = token_accuracy(logits, labels, shift)
        return correct, counted
    return 0, 0


def shift_convention(model, data) -> bool | None:
    """True for next-token models we know (HF causal LMs, the built-in task); None for a user's own."""
    if data.task == "causal-lm" or getattr(model, "loss_type", None) == "ForCausalLM":
        return True
    return None


def val_metrics(model, data, device, *, batch_size: int, max_batches: int | None, precision: str,
                on_batch=None) -> dict:
    """Loss and accuracy over the validation split in batches of ``batch_size`` (``Spec.eval_batch_size``), its
    first ``max_batches`` (``eval.max_batches``) when set, under ``precision``'s autocast (``train.precision``).

    ``on_batch(index, items, loss)`` sees each batch's loss before it is counted (the gate stops
    at a non-finite one and reports progress). The model is left in the mode it came in.
    """
    bs = batch_size
    total_loss = 0.0
    n_batches = n_examples = correct = counted = 0
    limit = max_batches or math.inf
    val = data.val
    shift = shift_convention(model, data)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast_for(device, precision):
            for start in range(0, len(val), bs):
                if n_batches >= limit:
                    break
                items = [val[i] for i in range(start, min(len(val), start + bs))]
                batch = to_device(data.collate(items), device)
                out = model(**batch)
                loss = float(loss_of(out))
                if on_batch is not None:
                    on_batch(n_batches, items, loss)
                c, k = accuracy_counts(out, batch.get("labels"), shift)
                correct, counted = correct + c, counted + k
                total_loss += loss * len(items)
                n_examples += len(items)
                n_batches += 1
                del out, batch
    finally:
        model.train(was_training)
    return {"val_loss": total_loss / max(n_examples, 1), "accuracy": correct / counted if counted else None,
            "examples": n_examples, "batches": n_batches}


def outputs_of(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The model's logits (else its loss) on ``batch`` in eval mode, as float32 on the CPU, for comparison."""
    model.eval()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    with torch.no_grad():
        out = model(**batch)
    logits = logits_of(out)
    if logits is None:
        logits = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if not isinstance(logits, torch.Tensor):
        raise RuntimeError("the model returned neither logits nor loss to compare")
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return logits.detach().float().cpu()
