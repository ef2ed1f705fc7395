"""Batches as the loss sees them: on the device, under autocast, their length and their supervised labels.

The one place each of these is computed: the loop, the gates and the estimator all call them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..config.sections import AUTOCAST_DTYPE

IGNORE = -100  # the label of a position that is not supervised (Hugging Face's and PyTorch's convention)


def labelled_batch(batch) -> dict | None:
    """The collate's output as the loop's contract reads it: a dict of tensors with 'labels'. A Mapping that is not a
    dict (transformers' collators return a BatchEncoding) is copied into one; anything else, or no 'labels', is
    None."""
    if not isinstance(batch, Mapping) or "labels" not in batch:
        return None
    return batch if type(batch) is dict else dict(batch)


def to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):  # a dict, or a collator's BatchEncoding (a UserDict)
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


# The 2-byte compute dtypes by the names train.precision and the CLI use.
HALF_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def half_name(dtype: torch.dtype) -> str:
    """``HALF_DTYPES``' name for ``dtype``."""
    return next(name for name, d in HALF_DTYPES.items() if d == dtype)


def dtype_names(tensors: Iterable[torch.Tensor]) -> list[str]:
    """The distinct dtypes of ``tensors`` by torch's short names ("float32", "bfloat16", "uint8"), sorted."""
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


def cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    """The batch with its floating tensors in ``dtype`` (integer ids and labels unchanged)."""
    if isinstance(batch, Mapping):  # a dict, or a collator's BatchEncoding (a UserDict)
        return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(cast_floats(v, dtype) for v in batch)
    return batch.to(dtype) if isinstance(batch, torch.Tensor) and batch.is_floating_point() else batch


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Autocast on the device's type in the dtype ``train.precision`` autocasts to (``config.sections.AUTOCAST_DTYPE``:
    bf16, fp16, and bf16 over bf16 weights for bf16-true-autocast); nothing for fp32 and bf16-true (the weights
    themselves are bf16)."""
    name = AUTOCAST_DTYPE.get(precision)
    if name is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=HALF_DTYPES[name])


def seq_len(batch) -> int:
    """The sequence length of a batch (``input_ids``' last dimension), 0 for inputs without a sequence."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.ndim >= 2 else 0


def item_length(item, collate) -> int:
    """The sequence length of one dataset item (0 for inputs without a sequence, e.g. images)."""
    ids = item.get("input_ids") if isinstance(item, dict) else None
    if isinstance(ids, (list, tuple)) or (isinstance(ids, torch.Tensor) and ids.ndim == 1):
        return len(ids)
    return seq_len(collate([item]))


def supervised_count(batch, shift_labels: bool) -> int:
    """Supervised labels in a batch (``labels != -100``); next-token positions only (``labels[..., 1:]``) when
    the model shifts its labels, as Hugging Face causal LMs do. 0 for a batch without labels."""
    # Any mapping: a tokenizer's BatchEncoding is a UserDict, not a dict.
    labels = batch.get("labels") if hasattr(batch, "keys") and hasattr(batch, "get") else None
    if not isinstance(labels, torch.Tensor):
        return 0
    if shift_labels and labels.ndim >= 2:
        labels = labels[..., 1:]
    return int((labels != IGNORE).sum())


def loss_of(out) -> torch.Tensor:
    """The scalar loss of a forward's output (``.loss`` or ``["loss"]``), as the factory contract promises."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        loss = out.get("loss") if hasattr(out, "get") else None
    else:
        loss = getattr(out, "loss", None)
    if loss is None:
        raise TypeError(
            f"forward returned {type(out).__name__} without a loss; the contract wants an object with .loss "
            "or a mapping with 'loss' when the batch has 'labels'"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"the loss must be a scalar tensor, got {type(loss).__name__} of shape "
                        f"{getattr(loss, 'shape', '?')}")
    return loss.reshape(())


def logits_of(out) -> torch.Tensor | None:
    return out.get("logits") if isinstance(out, dict) else getattr(out, "logits", None)
