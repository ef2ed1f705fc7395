"""Matmuls whose leading dimensions leave the tensor cores' alignment: said in the time row, not modelled.

cuBLAS picks its fastest tensor-core kernels for a half-precision matmul only when its operands' leading dimensions
are multiples of 16 bytes (8 bf16/fp16 elements: NVIDIA's "Matrix Multiplication Background User's Guide", "Tensor
Core Requirements"); otherwise it runs slower ones. A row-major operand's leading dimension is its row length: a
Linear's features, never its token count. The common cases are a vocabulary of an odd size in the head's matmul and
its two gradients (GPT-2's 50257 tokens, or 32001 after a pad token was added to Llama's 32000), and eager attention's
scores at an odd sequence length. How much slower depends on the shape, the GPU and the library version, and pilotrun
has no table of it, so the estimate does not pretend: it keeps the roofline time, calls it a lower bound, names the
matmuls and the fix. The one published magnitude for the common case: nanoGPT's update on an A100 took ~113 ms with
its 50257-token vocabulary and ~87 ms with it padded to 50304 (pytorch.org blog "Accelerating Large Language Models
with Accelerated Transformers", 2023; bench/published/nanogpt-124m.yaml).

Example::

    view = unaligned_view(trace["stages"]["steady_step"])
    view["note"] if view else "every matmul aligned"
"""
from __future__ import annotations

import math

# Below this share of a micro batch's FLOPs an unaligned matmul (a classifier's 2-label head) changes nothing a person
# would act on: not said.
MIN_SHARE = 0.01
# What a feature dimension is padded to: 64 elements, the multiple nanoGPT and transformers'
# resize_token_embeddings(pad_to_multiple_of=64) use (128 bytes at bf16, what the guide recommends for A100); a
# sequence length to the 8 a data collator's pad_to_multiple_of takes for tensor cores.
PAD_FEATURES = 64
PAD_SEQUENCE = 8
SHOWN_MODULES = 3


def unaligned_view(step: dict) -> dict | None:
    """What a stage's unaligned matmuls (trace.StageTrace.unaligned_matmuls) take of its micro batch's FLOPs, the
    modules they run in, the odd leading dimensions with what each pads to, and the note the time row and the estimate
    print; None when they take less than ``MIN_SHARE`` (or the trace predates them)."""
    rows = step.get("unaligned_matmuls") or []   # rows as ops.OpCosts writes them (a cached trace's: cache._check)
    total = sum(f * n for _, f, _, n in step.get("ops") or [])
    if not rows or not total:
        return None
    share = sum(r[4] * r[5] for r in rows) / total
    if share < MIN_SHARE:
        return None
    modules = list(dict.fromkeys(m or "(outside any module)" for r in rows for m in r[7]))
    seq = int(step.get("seq_len") or 0)
    padded = [_padding(d, seq) for d in sorted({d for r in rows for d in r[6]})]
    where = ", ".join(modules[:SHOWN_MODULES]) + (f" and {len(modules) - SHOWN_MODULES} more"
                                                  if len(modules) > SHOWN_MODULES else "")
    fixes = []
    if any(p["what"] == "features" for p in padded):
        fixes.append(f"pad a feature dimension to a multiple of {PAD_FEATURES} (a vocabulary: "
                     f"model.resize_token_embeddings(n, pad_to_multiple_of={PAD_FEATURES}), or model.config.vocab_size "
                     "for a model built from its config)")
    if any(p["what"] == "sequence length" for p in padded):
        fixes.append(f"pad every batch to a multiple of {PAD_SEQUENCE} tokens (the data collator's "
                     f"pad_to_multiple_of={PAD_SEQUENCE})")
    note = (f"a lower bound: {share:.0%} of the micro batch's FLOPs run in matmuls whose leading dimension is not a "
            f"multiple of 16 bytes ({where}; {short(padded)}), which cuBLAS runs with slower kernels by an amount not "
            f"modelled. To fix: {'; '.join(fixes)}. nanoGPT's update on an A100 went from ~113 to ~87 ms with its "
            "vocabulary padded from 50257 to 50304 (pytorch.org blog, 2023)")
    return {"flops_share": share, "modules": modules, "dimensions": padded, "note": note}


def _padding(size: int, seq_len: int) -> dict:
    """An odd leading dimension, what it is (the traced sequence length, else a feature dimension) and what it pads
    to."""
    what, step = ("sequence length", PAD_SEQUENCE) if size == seq_len else ("features", PAD_FEATURES)
    return {"size": size, "padded": math.ceil(size / step) * step, "what": what}


def short(dimensions: list[dict]) -> str:
    """The odd dimensions and what each pads to: "50257 -> 50304"."""
    return ", ".join(f"{d['size']} -> {d['padded']}" for d in dimensions)
