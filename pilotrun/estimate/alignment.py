"""Matmuls whose dimensions leave the tensor cores' alignment: said in the time row, not modelled.

cuBLAS picks its fastest tensor-core kernels only when a half-precision matmul's M, N and K are multiples of 16 bytes
(8 bf16/fp16 elements, 16 fp8 ones: NVIDIA's "Matrix Multiplication Background User's Guide", "Tensor Core
Requirements"); otherwise it runs slower ones. The common case is a vocabulary of an odd size in the head's matmul
and its two gradients: GPT-2's 50257 tokens, or 32001 after a pad token was added to Llama's 32000. How much slower
depends on the shape, the GPU and the library version, and pilotrun has no table of it, so the estimate does not
pretend: it keeps the roofline time, calls it a lower bound, names the matmuls and the fix. The one published
magnitude for the common case: nanoGPT's update on an A100 took ~113 ms with its 50257-token vocabulary and ~87 ms
with it padded to 50304 (pytorch.org blog "Accelerating Large Language Models with Accelerated Transformers", 2023;
bench/published/nanogpt-124m.yaml).

Example::

    view = unaligned_view(trace["stages"]["steady_step"])
    view["note"] if view else "every matmul aligned"
"""
from __future__ import annotations

import math

# Below this share of a micro batch's FLOPs an unaligned matmul (a classifier's 2-label head) changes nothing a person
# would act on: not said.
MIN_SHARE = 0.01
_ALIGN = {"bf16": 8, "fp16": 8, "fp8": 16}
# What a padded dimension is rounded up to: 64 elements, the multiple nanoGPT and transformers'
# resize_token_embeddings(pad_to_multiple_of=64) use (128 bytes at bf16, what the guide recommends for A100).
PAD_TO = 64


def unaligned_view(step: dict) -> dict | None:
    """What a stage's unaligned matmuls (trace.StageTrace.unaligned_matmuls) take of its micro batch's FLOPs, by
    module, with the note the time row and the estimate print; None when they take less than ``MIN_SHARE`` (or the
    trace predates them)."""
    rows = [r for r in step.get("unaligned_matmuls") or [] if isinstance(r, list) and len(r) == 7]
    total = sum(f * n for _, f, _, n in step.get("ops") or [])
    if not rows or not total:
        return None
    off = sum(r[4] * r[5] for r in rows)
    share = off / total
    if share < MIN_SHARE:
        return None
    by_module: dict[str, dict] = {}
    odd: set[int] = set()
    for dtype, m, n, k, flops, count, module in rows:
        align = _ALIGN.get(dtype, 8)
        odd.update(d for d in (m, n, k) if d % align)
        entry = by_module.setdefault(module or "(outside any module)", {"flops": 0, "shapes": []})
        entry["flops"] += flops * count
        entry["shapes"].append(f"{m}x{n}x{k} {dtype}")
    modules = [{"module": name, "flops_share": e["flops"] / total, "shapes": e["shapes"]}
               for name, e in sorted(by_module.items(), key=lambda kv: -kv[1]["flops"])]
    padded = {d: math.ceil(d / PAD_TO) * PAD_TO for d in sorted(odd)}
    where = ", ".join(m["module"] for m in modules[:3]) + (" ..." if len(modules) > 3 else "")
    dims = ", ".join(f"{d} (padded: {p})" for d, p in padded.items())
    note = (f"a lower bound: {share:.0%} of the micro batch's FLOPs run in matmuls with a dimension that is not a "
            f"multiple of 16 bytes ({where}; {dims}), which cuBLAS runs with slower kernels by an amount not modelled. "
            f"Pad it to a multiple of {PAD_TO} (a vocabulary: model.resize_token_embeddings(n, pad_to_multiple_of="
            f"{PAD_TO}), or model.config.vocab_size for a model built from its config): nanoGPT's update on an A100 "
            "went from ~113 to ~87 ms with its vocabulary padded from 50257 to 50304 (pytorch.org blog, 2023)")
    return {"flops_share": share, "modules": modules,
            "dimensions": [{"size": d, "padded": p} for d, p in padded.items()], "note": note}
