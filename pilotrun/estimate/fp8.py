"""FP8 training in the estimate: the Linears torchao would convert, their matmuls at the accelerator's FP8 peak, and
the casts that feed them.

The trace marks the matmuls of every Linear ``train/fp8.choose_linears`` would convert (every Linear but the output
head, dimensions multiples of 16) as it counts them (``ops.OpCosts(fp8_modules)``: forward, input gradient and
weight gradient, recomputed ones included), with the bytes each reads and writes. :func:`fp8_ops` turns one
micro batch's ops into FP8 training's:

* each marked matmul runs as ``torch._scaled_mm`` at the catalog's ``fp8`` peak, reading its operands as float8
  (1 byte an element) and writing its output in the high precision, as traced;
* each of its two operands is cast first (torchao 0.18, ``float8_linear.py``: six casts per Linear per micro
  batch, the output gradient cast twice). ``casts="fused"``: as torch.compile fuses them (torchao's recommended
  use): the operand read once for its amax and once to scale and cast, 1 byte written -- 2 x its size + 1 bytes an
  element. ``casts="eager"``: as torchao's eager code runs them (``float8_utils.tensor_to_amax``:
  ``max(abs(x))``; ``float8_training_tensor``: ``x.to(float32) * scale``, ``clamp``, ``.to(float8)``): 33 bytes an
  element for a bf16 or an fp32 operand. pilotrun's own loop runs eagerly.

Memory: torchao saves the high-precision input and weight for backward (``ctx.save_for_backward(input_hp,
weight_hp_t)``) and frees each float8 copy after its matmul, so the peak is the bf16 trace's. What is not
subtracted: the bf16 copies of converted weights that bf16 autocast makes (at most 2 bytes per converted parameter
over the estimate) and the autocast weight casts still counted in the time. The experts' grouped matmuls of a
mixture of experts are not nn.Linear and stay in bf16. With an adapter or a quantised base FP8 is not modelled.
"""
from __future__ import annotations

from collections import Counter

import torch

from ..ledger.records import TRAINING_GATES, GateName
from ..train.fp8 import choose_linears

# Bytes per element of the high precision a traced matmul reads (ops._PEAK_OF_DTYPE's names).
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# torchao 0.18's eager cast of one element (the module docstring): abs (read, write), max (read), to fp32 (read, write
# 4; none for fp32), x scale (read 4, write 4), clamp (read 4, write 4), to float8 (read 4, write 1).
EAGER_CAST_BYTES = 33
CASTS = ("eager", "fused")
MEMORY_NOTE = ("the bf16 trace's peak: torchao saves the high-precision input and weight for backward and frees each "
               "float8 copy after its matmul (torchao 0.18 float8_linear.py); the bf16 copies autocast makes of the "
               "converted weights are not subtracted (at most 2 bytes per converted parameter over)")


def not_modelled(spec) -> str | None:
    """Why FP8 training is not modelled for this job, or None."""
    if spec.model.adapter is not None or spec.model.quantization is not None:
        return "not modelled with an adapter or a quantised base (torchao converts the full model's Linears)"
    return None


def fp8_modules(model: torch.nn.Module, spec) -> frozenset[str]:
    """The Linears FP8 training would convert, named as FlopCounterMode's module tracker names them (the root
    module's class name, then the path); empty where FP8 is not modelled."""
    if not_modelled(spec):
        return frozenset()
    chosen, _ = choose_linears(model)
    root = type(model).__name__
    return frozenset(f"{root}.{name}" for name in chosen)


def fp8_facts(model: torch.nn.Module, spec) -> dict:
    """What the trace says about FP8 (TraceResult.fp8): the Linears converted and the skipped ones by reason."""
    if (why := not_modelled(spec)) is not None:
        return {"modelled": False, "why": why}
    chosen, skipped = choose_linears(model)
    return {"modelled": True, "linears": len(chosen), "skipped": dict(Counter(skipped.values()))}


def cast_bytes(element_bytes: int, casts: str) -> int:
    """Bytes moved to cast one element of an operand to float8."""
    return EAGER_CAST_BYTES if casts == "eager" else 2 * element_bytes + 1


def fp8_ops(ops: list[list], marked: list[list], casts: str) -> list[list]:
    """One micro batch's ``ops`` ([dtype, flops, bytes, count]) with the ``marked`` matmuls ([dtype, flops, bytes
    read, bytes written, count], a subset) as FP8 training runs them: the scaled matmul at the fp8 peak and its
    operands' casts, memory-bound rows of the operands' dtype (see the module)."""
    if casts not in CASTS:
        raise ValueError(f"casts is one of {', '.join(CASTS)}, got {casts!r}")
    left = Counter({(d, f, b): n for d, f, b, n in ops})
    out: list[list] = []
    for d, f, read, written, n in marked:
        left[(d, f, read + written)] -= n
        size = ELEMENT_BYTES.get(d, 2)
        elements = read // size
        out.append(["fp8", f, elements + written, n])
        out.append([d, 0, elements * cast_bytes(size, casts), n])
    if any(n < 0 for n in left.values()):
        raise ValueError("the marked matmuls are not a subset of the traced ops")
    return [[d, f, b, n] for (d, f, b), n in left.items() if n > 0] + out


def fp8_trace(trace: dict, casts: str) -> dict | None:
    """The trace with its training stages' ops as FP8 training runs them (precision ``fp8``); None when the trace
    has no marked matmuls (written before FP8 was counted, FP8 not modelled, or no Linear to convert)."""
    steady = trace["stages"][GateName.STEADY_STEP]
    if not steady.get("fp8_ops") or not steady.get("ops"):
        return None
    rows = [r for name in TRAINING_GATES for r in trace["stages"][name].get("fp8_ops") or []]
    if not all(isinstance(r, list) and len(r) == 5 and r[0] in ELEMENT_BYTES
               and all(isinstance(v, int) and v >= 0 for v in r[1:]) for r in rows):
        return None   # a cache entry edited by hand: no FP8 figure rather than a wrong one
    stages = dict(trace["stages"])
    for name in TRAINING_GATES:
        st = stages[name]
        stages[name] = {**st, "ops": fp8_ops(st["ops"], st.get("fp8_ops") or [], casts)}
    return {**trace, "stages": stages, "precision": "fp8", "fp8_casts": casts}


def why_none(trace: dict) -> str:
    """Why :func:`fp8_trace` gave nothing, for the row."""
    facts = trace.get("fp8") or {}
    if facts.get("modelled") is False:
        return f"FP8 {facts.get('why')}"
    if not facts:
        return "the trace predates FP8 counting: trace again (--no-trace-cache) to see the FP8 path"
    if not facts.get("linears"):
        return "no Linear to convert (" + "; ".join(f"{n}: {w}" for w, n in (facts.get("skipped") or {}).items()) + ")"
    return "no marked matmul in the trace"
