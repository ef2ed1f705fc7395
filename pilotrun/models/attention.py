"""The attention kernel a model runs on its target accelerator, and the estimator's model of it.

What attention keeps for backward decides much of a long-sequence job's memory, and the kernel that runs it is
chosen by the target, not by the CPU the estimator traces on:

=====================  ===============================================================================================
``model.attn_implementation``  what runs on a CUDA/ROCm target, and what it keeps for backward
=====================  ===============================================================================================
sdpa (transformers'    torch's ``scaled_dot_product_attention`` dispatches to FlashAttention-2 (fp16/bf16, no mask) or
default)               the memory-efficient kernel (a mask, or fp32): both keep their output and one fp32 logsumexp per
                       query and head, never the L x L scores (torch/nn/attention docs; aten
                       ``_scaled_dot_product_{flash,efficient}_attention`` return ``(output, logsumexp, ...)``).
flash_attention_2/3    the flash-attn package (transformers' ``flash_attention_forward``): the same output + logsumexp,
                       with key and value at their own (grouped-query) head count, never repeated.
eager                  the model's own matmul + softmax: the L x L scores and probabilities kept, as on the CPU.
=====================  ===============================================================================================

The CPU trace would otherwise keep whatever CPU dispatch picked: its flash kernel (the same tensors as the target's)
in the common case, but the math path -- L x L fp32 scores kept for backward, fp32 ``bmm`` timed at the fp32 peak --
when a model's inputs do not suit it. :func:`model_target_attention` replaces every attention call of an sdpa or
flash model by ``pilotrun_trace::flash_attention``, an op that keeps exactly the target kernel's tensors and whose
FLOPs are SDPA's, and records which kernel CPU dispatch would have run instead.

Example::

    with model_target_attention("sdpa") as record, record.counting():
        loss = model(**batch).loss; loss.backward()
    record.calls, record.cpu_kernels            # 24, {"math": 24}: what the CPU would have run instead
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config.sections import ATTN_IMPLEMENTATIONS as IMPLEMENTATIONS

FLASH_IMPLEMENTATIONS = tuple(i for i in IMPLEMENTATIONS if i.startswith("flash_attention"))
TRACE_FLASH = "pilotrun_trace_flash"   # the transformers attention function the trace registers for flash models

# torch.nn.attention.SDPBackend's values, as aten._fused_sdp_choice returns them.
_SDP_BACKENDS = {0: "math", 1: "flash", 2: "memory-efficient", 3: "cudnn", 4: "overrideable"}


def _repeat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    rep = q.shape[-3] // k.shape[-3]
    return k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3), rep


def _scores(q, k, is_causal: bool, scale: float) -> torch.Tensor:
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        scores = scores.masked_fill(torch.ones(L, S, dtype=torch.bool, device=q.device).triu(S - L + 1), -math.inf)
    return scores


def _math_attention(q, k, v, is_causal: bool, scale: float):
    """Reference values (real tensors only: a test or a pilot that calls the op outside a trace)."""
    k, v, _ = _repeat(q, k, v)
    scores = _scores(q, k, is_causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
    return out, lse


def _math_backward(grad, q, k, v, out, lse, is_causal: bool, scale: float):
    """The flash backward's arithmetic from the kept tensors: P = exp(S - lse), dS = P * (dO V^T - rowsum(dO * O))."""
    kr, vr, rep = _repeat(q, k, v)
    p = torch.exp(_scores(q, kr, is_causal, scale) - lse.unsqueeze(-1))
    g = grad.float()
    dv = p.transpose(-1, -2) @ g
    ds = p * (g @ vr.float().transpose(-1, -2) - (g * out.float()).sum(-1, keepdim=True))
    dq = (ds @ kr.float()) * scale
    dk = (ds.transpose(-1, -2) @ q.float()) * scale
    if rep > 1:   # the repeated heads' gradients sum into their key/value head
        dk = dk.unflatten(-3, (k.shape[-3], rep)).sum(-3)
        dv = dv.unflatten(-3, (v.shape[-3], rep)).sum(-3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("pilotrun_trace::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A flash kernel's forward: (output like q with v's head size, fp32 logsumexp per query and head)."""
    return _math_attention(q, k, v, is_causal, scale)


@flash_attention.register_fake
def _(q, k, v, is_causal, scale):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(q.shape[:-1], dtype=torch.float32)   # one logsumexp per query and head


@torch.library.custom_op("pilotrun_trace::flash_attention_backward", mutates_args=())
def flash_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A flash kernel's backward: gradients of q, k and v from the kept q, k, v, output and logsumexp."""
    return _math_backward(grad, q, k, v, out, lse, is_causal, scale)


@flash_attention_backward.register_fake
def _(grad, q, k, v, out, lse, is_causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)   # exactly what the target's kernel keeps
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward(grad_out.contiguous(), q, k, v, out, lse, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


flash_attention.register_autograd(_backward, setup_context=_setup)


def _register_flops() -> None:
    """SDPA's FLOP formulas for the modelled kernel (what torch counts for its own flash kernel)."""
    import torch.utils.flop_counter as fc

    if torch.ops.pilotrun_trace.flash_attention.default in fc.flop_registry:
        return

    @fc.register_flop_formula(torch.ops.pilotrun_trace.flash_attention)
    def _fwd(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(q_shape, k_shape, v_shape)

    @fc.register_flop_formula(torch.ops.pilotrun_trace.flash_attention_backward)
    def _bwd(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)


_register_flops()


def modelled_attention_ops() -> frozenset:
    """The modelled kernel's forward op: per-op checkpointing keeps its output as it keeps aten's attention kernels."""
    return frozenset({torch.ops.pilotrun_trace.flash_attention.default})


@dataclass
class AttentionRecord:
    """What the trace modelled: the implementation, the target kernel, its calls, and what the CPU would have run."""

    implementation: str
    kernel: str                 # what runs on the target: "flash or memory-efficient", "flash-attn", "as traced"
    calls: int = 0              # forward calls (a recompute in backward is not counted)
    cpu_kernels: Counter = field(default_factory=Counter)   # CPU dispatch's choice for the same inputs, by name
    counted: bool = False       # inside counting(): only then are calls counted

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the calls made inside (one micro batch's), and only those: the trace runs many passes."""
        self.calls, self.cpu_kernels, self.counted = 0, Counter(), True
        try:
            yield
        finally:
            self.counted = False

    def count(self, cpu_kernel: str) -> None:
        if self.counted and torch._C._current_graph_task_id() == -1:   # a forward's call, not a recompute's
            self.calls += 1
            self.cpu_kernels[cpu_kernel] += 1

    def to_dict(self) -> dict:
        return {"implementation": self.implementation, "kernel": self.kernel, "calls": self.calls,
                "cpu_kernels": dict(self.cpu_kernels)}


def _cpu_choice(q, k, v, mask, dropout: float, is_causal: bool, enable_gqa: bool) -> str:
    """The kernel CPU dispatch picks for inputs of these shapes, dtypes and mask: asked with real tensors of the same
    layout outside the trace's modes (inside a checkpointed region's dispatch mode torch answers math for every
    input), once per distinct signature."""
    def sig(t):
        return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype)

    key = (sig(q), sig(k), sig(v), sig(mask), dropout, is_causal, enable_gqa)
    if key not in _CHOICES:
        from torch.utils._python_dispatch import _disable_current_modes

        def real(t):
            return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)

        try:
            with _disable_current_modes():
                chosen = torch.ops.aten._fused_sdp_choice(real(q), real(k), real(v), real(mask), dropout, is_causal,
                                                          enable_gqa=enable_gqa)
            _CHOICES[key] = _SDP_BACKENDS.get(int(chosen), "unknown")
        except Exception:   # an older torch without the keyword, or inputs it refuses: said, not guessed
            _CHOICES[key] = "unknown"
    return _CHOICES[key]


_CHOICES: dict[tuple, str] = {}


def _autocast(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """SDPA is on autocast's lower-precision list (CUDA and CPU alike): its inputs are cast as the aten op's are."""
    if not torch.is_autocast_enabled("cpu"):
        return list(tensors)
    dtype = torch.get_autocast_dtype("cpu")
    return [t.to(dtype) if t.is_floating_point() else t for t in tensors]


def _modelled(q, k, v, is_causal: bool, scale: float | None) -> torch.Tensor:
    q, k, v = _autocast(q, k, v)
    out, _ = flash_attention(q, k, v, bool(is_causal), float(scale if scale is not None else q.shape[-1] ** -0.5))
    return out


@contextlib.contextmanager
def _target_sdpa(record: AttentionRecord) -> Iterator[None]:
    """Every ``torch.nn.functional.scaled_dot_product_attention`` call becomes the modelled target kernel. The
    function itself is swapped (not a TorchFunctionMode: checkpointing's recompute in backward runs without the
    mode, and would then meet a different op than its forward saved); the trace runs in a process of its own."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if record.counted:
            q, k, v = _autocast(query, key, value)   # what the aten op would receive
            record.count(_cpu_choice(q, k, v, attn_mask, float(dropout_p), bool(is_causal), bool(enable_gqa)))
        return _modelled(query, key, value, bool(is_causal), scale)

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _flash_forward(record: AttentionRecord):
    """A transformers attention function for flash_attention_2/3 models: key and value at their own head count."""

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and query.shape[2] > 1
        record.count("flash-attn")
        out = _modelled(query, key, value, causal, scaling)
        return out.transpose(1, 2).contiguous(), None

    return forward


def _set_transformers_attention(model: torch.nn.Module, name: str) -> list[tuple[Any, str]]:
    """Point every transformers config in ``model`` at attention function ``name``; the old values to put back."""
    changed: list[tuple[Any, str]] = []
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and all(c is not config for c, _ in changed):
            changed.append((config, config._attn_implementation))
            config._attn_implementation = name
    return changed


AS_TRACED_ON_CPU = "as this CPU runs it"


@contextlib.contextmanager
def model_target_attention(implementation: str, model: torch.nn.Module | None = None,
                           target: str = "cuda") -> Iterator[AttentionRecord]:
    """Inside: attention runs as ``implementation`` runs on the target (see the module's table). ``eager`` changes
    nothing (the model's own ops are what the target runs), nor does a CPU ``target`` (what the trace runs is what
    the CPU runs). A flash implementation needs the transformers ``model`` whose attention function is swapped for
    the modelled kernel's; sdpa catches every SDPA call, whoever makes it."""
    if target == "cpu":
        yield AttentionRecord(implementation, AS_TRACED_ON_CPU)
        return
    if implementation == "eager":
        yield AttentionRecord(implementation, "as traced (the model's own matmul and softmax)")
        return
    if implementation in FLASH_IMPLEMENTATIONS:
        from transformers import AttentionInterface

        record = AttentionRecord(implementation, "flash-attn (output + logsumexp kept; key and value unrepeated)")
        AttentionInterface.register(TRACE_FLASH, _flash_forward(record))
        changed = _set_transformers_attention(model, TRACE_FLASH) if model is not None else []
        try:
            with _target_sdpa(record):   # a model that calls SDPA itself
                yield record
        finally:
            for config, old in changed:
                config._attn_implementation = old
        return
    record = AttentionRecord(implementation, "flash or memory-efficient SDPA (output + logsumexp kept)")
    with _target_sdpa(record):
        yield record
