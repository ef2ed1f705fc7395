"""CUDA's autocast op lists, in a trace that runs on this CPU.

The trace runs ``torch.autocast`` on the CPU, whose lists are not CUDA's (ROCm runs CUDA's). Both run matmul,
linear, bmm and attention in the lower precision; CUDA also runs the ops below in fp32 whatever their inputs' dtype,
the CPU only the losses among them. Two things the target then holds that the CPU would not:

* with bf16 weights under autocast (``train.precision: bf16-true-autocast``) the residual stream is bf16, and a
  LayerNorm model's norms run in fp32 on the target: an fp32 copy of their weights, fp32 outputs;
* under any autocast, a softmax of bf16 scores (an eager attention that does not ask for a dtype) keeps its fp32
  probabilities for backward.

Inside :func:`cuda_autocast_lists`, while autocast is on, the floating inputs of those ops are cast to fp32 as CUDA's
autocast casts them (an explicit ``dtype=`` is left alone, as autocast leaves it). The functions themselves are
swapped, as ``models.attention`` swaps SDPA: a TorchFunctionMode is not active in the recompute of activation
checkpointing (backward), which would then meet other ops than its forward saved. Source: PyTorch's Automatic Mixed
Precision reference, "CUDA Ops that can autocast to float32" (https://pytorch.org/docs/stable/amp.html).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

# "CUDA Ops that can autocast to float32", as the reference lists them.
CUDA_FP32_OPS = (
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh",
    "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss")
# Where a model reaches them: torch.nn.functional (nn.LayerNorm, transformers' eager attention), torch, and the
# Tensor's own methods.
OWNERS: tuple[Any, ...] = (torch.nn.functional, torch, torch.Tensor)
LOWER = (torch.bfloat16, torch.float16)


def _up(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in LOWER:
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_up(v) for v in value)
    return value


def _fp32(original):
    @functools.wraps(original)
    def run(*args, **kwargs):
        if kwargs.get("dtype") is None and torch.is_autocast_enabled("cpu"):
            args, kwargs = _up(args), {k: _up(v) for k, v in kwargs.items()}
        return original(*args, **kwargs)

    return run


@contextlib.contextmanager
def cuda_autocast_lists(target: str) -> Iterator[None]:
    """Inside: CUDA's fp32 autocast list applies to the trace's CPU autocast (nothing changes for a CPU target)."""
    if target == "cpu":
        yield
        return
    swapped: list[tuple[Any, str, Any]] = []   # (owner, name, its own attribute; None: inherited, from TensorBase)
    try:
        for owner in OWNERS:
            for name in CUDA_FP32_OPS:
                original = getattr(owner, name, None)
                if callable(original):
                    swapped.append((owner, name, vars(owner).get(name)))
                    setattr(owner, name, _fp32(original))
        yield
    finally:
        for owner, name, own in reversed(swapped):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
