"""Mixtures of experts in the trace: the experts' grouped matmuls counted, and the routing said, never guessed.

transformers' MoE models (Qwen3-MoE, Mixtral, OLMoE, and every class decorated with ``use_experts_implementation``)
keep their experts as 3D parameters ``[experts, out, in]`` and run them, by default (``experts_implementation
"grouped_mm"``), as ``torch._grouped_mm`` over the tokens sorted by expert: one kernel for all experts of a layer,
``tokens x top_k`` rows. Three things the trace needs that torch does not give it:

* **FLOPs.** ``FlopCounterMode`` has no formula for ``aten._grouped_mm`` (nor for transformers' own
  ``grouped_mm_fallback`` custom op, used where grouped_mm cannot run): the experts counted zero, and the time per
  update was the dense part's alone. :func:`register_expert_flops` adds them, as torch counts ``mm``: 2 x rows x
  contraction x columns, each row multiplied by its one expert's matrix.
* **dtypes.** torch's meta kernel for ``_grouped_mm`` (the fake tensors' kernel) checks what the CUTLASS fast path
  takes -- bf16 only -- but the real kernels run other dtypes too: CUDA's ``_grouped_mm_cuda`` falls back to a
  per-expert ``mm`` for anything but bf16 (aten/src/ATen/native/cuda/GroupedBlas.cpp), and the CPU's composite
  kernel is that same fallback. ``_grouped_mm`` is on no autocast list (``AutocastCUDA`` has no kernel for it), and
  transformers casts the tokens to the experts' weights' dtype before the call (its ``_grouped_mm`` helper, citing
  pytorch issue 174763). So with fp32 weights (fp32, bf16 and fp16 autocast) the experts run in fp32 on the GPU, and
  the trace failed with "Expected inputs of BF16 type". :func:`allow_fallback_dtypes` gives the meta kernel the
  dtypes the real kernels run; the experts are then traced -- and timed -- in the dtype the GPU runs them in.
* **routing.** Fake tensors carry no values: the trace cannot know which expert a token goes to. The grouped kernel's
  shapes do not depend on it (every one of the ``tokens x top_k`` rows goes through one expert), so FLOPs, bytes and
  activations of pilotrun's strategies (every GPU holds -- or, under FSDP, gathers -- every expert and runs them over
  its own tokens) are those of any routing. What routing changes is the busiest expert's tokens: the spec's
  ``model.moe.routing_imbalance`` (1.0: balanced) states it, and the row says it. Expert parallelism (experts placed
  on different GPUs, tokens sent with all-to-all, the busiest expert's GPU the step's pace) is not a strategy here:
  the row says so, and no number assumes it.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

# transformers' MoE knobs, as its configs name them: experts per layer (Qwen3-MoE, OLMoE: num_experts; Mixtral:
# num_local_experts) and experts per token.
_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")

EXPERT_PARALLELISM = ("expert parallelism not modelled: experts are sharded as FSDP shards every parameter (each GPU "
                      "gathers every expert and runs it over its own tokens; no all-to-all token dispatch)")

_FLOPS_REGISTERED = False
_META_REGISTERED: list[Any] = []   # the Library holding the meta kernel, kept alive for the process


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """``_grouped_mm``'s FLOPs: 2 x rows x contraction x columns, whatever the layout (torch's four cases).

    2D x 3D (the forward, and the input's gradient): a [rows, k] jagged over experts, b [experts, k, n].
    2D x 2D (the weights' gradient): a [k, rows], b [rows, n] jagged along rows; output [experts, k, n].
    3D x 2D: a [experts, m, k], b [k, cols] jagged along cols. 3D x 3D: a batched matmul.
    Every row of the jagged operand is counted: transformers' offsets end at the last row (without expert
    parallelism no row is left out).
    """
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2 * a_shape[1] * a_shape[2] * b_shape[-1]
    size = 1
    for d in a_shape:
        size *= d
    return 2 * size * b_shape[-1]


def _fallback_flops(input_shape, weight_shape, *args, **kwargs) -> int:
    """transformers::grouped_mm_fallback: input [rows, k] over weight [experts, k, n]."""
    return 2 * input_shape[0] * input_shape[1] * weight_shape[-1]


def _fallback_backward_flops(input_shape, weight_shape, offs_shape, grad_shape, *args, **kwargs) -> int:
    """Its backward: the input's gradient and the weights', each as many FLOPs as the forward."""
    return 2 * _fallback_flops(input_shape, weight_shape)


def expert_ops() -> list[Any]:
    """The expert kernels the trace counts apart (OpOverloadPackets present in this torch and transformers)."""
    found = [getattr(torch.ops.aten, "_grouped_mm", None)]
    namespace = getattr(torch.ops, "transformers", None)
    if namespace is not None:
        for name in ("grouped_mm_fallback", "grouped_mm_fallback_backward"):
            try:
                found.append(getattr(namespace, name))
            except (AttributeError, RuntimeError):   # transformers not imported yet, or an older one
                continue
    return [op for op in found if op is not None]


def register_expert_flops() -> None:
    """FLOP formulas for the experts' kernels, in torch's registry (FlopCounterMode and OpCosts read it)."""
    global _FLOPS_REGISTERED
    import torch.utils.flop_counter as fc

    if _FLOPS_REGISTERED:
        return
    table = getattr(fc, "flop_registry", {})
    formulas = {"_grouped_mm": _grouped_mm_flops, "grouped_mm_fallback": _fallback_flops,
                "grouped_mm_fallback_backward": _fallback_backward_flops}
    for op in expert_ops():
        name = op._qualified_op_name.split("::")[-1] if hasattr(op, "_qualified_op_name") else str(op)
        formula = formulas.get(name.split(".")[0])
        if formula is not None and op.default not in table:
            fc.register_flop_formula(op)(formula)
    # Set once every kernel present was seen: transformers registers its custom ops on import, after this may run.
    _FLOPS_REGISTERED = len(expert_ops()) == 3


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """Meta kernel of ``aten._grouped_mm`` for every dtype the real kernels run (the fallback's per-expert mm):
    the output's shape as torch's own meta computes it, in ``out_dtype`` or the inputs' dtype."""
    torch._check(mat_a.dtype == mat_b.dtype, lambda: f"grouped_mm: mat_a is {mat_a.dtype}, mat_b {mat_b.dtype}")
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "grouped_mm takes 2D or 3D operands")
    dtype = out_dtype or mat_a.dtype
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        shape = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:
        shape = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        shape = [mat_a.size(1), mat_b.size(1)]
    else:
        shape = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return mat_a.new_empty(shape, dtype=dtype)


def allow_fallback_dtypes() -> None:
    """Give the fake tensors' ``_grouped_mm`` kernel the fp32 and fp16 the real kernels run (once per process).

    bf16 keeps torch's own meta kernel (its layout checks are the fast path's); other dtypes get
    :func:`_grouped_mm_meta`. Registered for the process, not scoped: under FakeTensorMode (torch 2.13) a meta
    kernel removed after an op had dispatched to it still ran; the trace runs in its own worker process anyway.
    """
    if _META_REGISTERED or not hasattr(torch.ops.aten, "_grouped_mm"):
        return
    try:
        from torch._meta_registrations import meta_grouped_mm as torch_meta
    except ImportError:   # another torch: its own meta kernel stays
        return

    def meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if mat_a.dtype == torch.bfloat16 or mat_a.dtype != mat_b.dtype:
            return torch_meta(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
        return _grouped_mm_meta(mat_a, mat_b, offs, bias, out_dtype)

    lib = torch.library.Library("aten", "IMPL", "Meta")
    with warnings.catch_warnings():   # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        lib.impl("_grouped_mm", meta)
    _META_REGISTERED.append(lib)


def _config_value(config: Any, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def expert_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """Modules that hold a layer's experts as stacked parameters (first dimension = its ``num_experts``), each with
    that number."""
    found = []
    for module in model.modules():
        n = getattr(module, "num_experts", None)
        if not isinstance(n, int) or n < 2:
            continue
        own = list(module.parameters(recurse=False))
        if own and all(p.dim() == 3 and p.shape[0] == n for p in own):
            found.append((module, n))
    return found


def describe(model: torch.nn.Module, config: Any, imbalance: float = 1.0) -> dict:
    """The model's experts as the row states them; {} for a model without experts."""
    experts = expert_modules(model)
    if not experts:
        return {}
    n_experts = max(n for _, n in experts)
    top_k = _config_value(config, _TOP_K_KEYS)
    expert_params = sum(p.numel() for m, _ in experts for p in m.parameters(recurse=False))
    per_expert = sum(p.numel() // n for m, n in experts for p in m.parameters(recurse=False))
    implementation = getattr(config, "_experts_implementation", None) if config is not None else None
    return {
        "moe_layers": len(experts),
        "experts": n_experts,
        "active_experts_per_token": top_k,
        "expert_parameters": expert_params,
        # Every MoE layer's top_k experts: the expert weights one token meets (6 x this x tokens: its training FLOPs).
        "active_expert_parameters": per_expert * top_k if top_k else None,
        "experts_implementation": implementation or "unknown",
        "routing_imbalance": imbalance,
        "router_aux_loss_coef": getattr(config, "router_aux_loss_coef", None),
        "output_router_logits": bool(getattr(config, "output_router_logits", False)),
    }


def with_costs(facts: dict, rows: list[list], tokens: int, grad_accum: int) -> dict:
    """``facts`` with the experts' counted FLOPs per update and their dtypes (OpCosts.expert_rows of one micro
    batch's forward and backward, ``tokens`` of them)."""
    if not facts:
        return facts
    flops = sum(f * n for _, f, _, n in rows)
    return facts | {"expert_flops_per_update": flops * grad_accum, "expert_bytes_per_micro_batch":
                    sum(b * n for _, _, b, n in rows), "expert_matmul_dtypes": sorted({d for d, *_ in rows}),
                    "tokens_per_micro_batch": tokens}


def routing(facts: dict) -> dict:
    """The routing assumed, per MoE layer and micro batch: the balanced share of tokens per expert and the busiest
    expert's (``routing_imbalance`` x that share, at most every token: a token meets an expert once)."""
    tokens, k, experts = facts.get("tokens_per_micro_batch"), facts.get("active_experts_per_token"), facts["experts"]
    imbalance = float(facts.get("routing_imbalance", 1.0))
    out: dict[str, Any] = {"assumption": "balanced" if imbalance == 1.0 else f"busiest expert at {imbalance:g}x "
                           "its balanced share", "routing_imbalance": imbalance}
    if tokens and k:
        share = tokens * k / experts
        out |= {"tokens_per_expert": share, "busiest_expert_tokens": min(float(tokens), share * imbalance)}
        if share * imbalance > tokens:
            out["capped"] = (f"{imbalance:g}x is above experts / experts per token = {experts / k:g}: the busiest "
                             "expert is given every token")
    out["effect"] = ("none on this estimate's FLOPs, memory or time: every GPU runs every expert over its own "
                     "tokens x experts per token rows, whichever expert each goes to")
    return out


def row(facts: dict) -> dict:
    """The ``moe`` part of an estimate: the traced facts, the routing assumed and what is not modelled."""
    if not facts:
        return {}
    return facts | {"routing": routing(facts), "expert_parallelism": EXPERT_PARALLELISM}


def note(facts: dict, precision: str) -> str:
    """One line for the estimate's corrections: what the trace counted for the experts and what it assumed."""
    k, total, active = (facts.get("active_experts_per_token"), facts.get("expert_parameters"),
                        facts.get("active_expert_parameters"))
    per_token = f"{active:,} of {total:,} expert parameters per token" if active else "experts per token unknown"
    dtypes = "/".join(facts.get("expert_matmul_dtypes") or []) or "no grouped matmul seen"
    parts = [f"{facts['moe_layers']} MoE layer(s) x {facts['experts']} experts, {k or 'unknown'} active per token "
             f"({per_token}); the experts' matmuls ({facts.get('experts_implementation')}) traced in {dtypes} and "
             f"counted: {facts.get('expert_flops_per_update', 0):.3g} FLOPs per update"]
    if "fp32" in dtypes and precision in ("bf16", "fp16"):
        parts.append(f"under {precision} autocast they run in fp32 on the GPU too: torch's _grouped_mm is on no "
                     "autocast list and transformers casts the tokens to the experts' fp32 weights (bf16-true runs "
                     "them in bf16)")
    r = routing(facts)
    busiest = f", busiest expert {r['busiest_expert_tokens']:.4g} tokens per micro batch" if "busiest_expert_tokens" \
        in r else ""
    parts.append(f"routing: {r['assumption']}{busiest} (model.moe.routing_imbalance), {r['effect']}")
    if facts.get("output_router_logits"):
        parts.append(f"the router's load-balancing loss is added to the loss x {facts.get('router_aux_loss_coef')} "
                     "(config.output_router_logits) and traced")
    parts.append(EXPERT_PARALLELISM)
    return "; ".join(parts)
