"""Each traced op's FLOPs and bytes moved, and its time on an accelerator as the larger of the two.

A step is not all matmuls: the optimizer step over every parameter, norms, element-wise ops, casts and the
loss over the vocabulary read and write memory and do (almost) no matmul work, and a small micro batch makes
even a matmul wait on its weights. FLOPs at a utilisation factor miss all of it. Here every op the trace runs
is kept with its FLOPs (``FlopCounterMode``'s formulas) and the bytes it reads and writes (its tensor inputs
and outputs; views move nothing), and on an accelerator its time is::

    max(flops / (dense peak of the op's dtype x compute efficiency),
        bytes / (datasheet memory bandwidth x bandwidth efficiency))

Repeated layers give the same (dtype, flops, bytes) many times: the trace keeps each once with its count, so
a 32-layer model's step is a few hundred rows. What this does not model: kernel launch gaps (they matter for
tiny steps, not the rented jobs), caches (an op whose inputs are still in L2 reads less), fusion the eager step
does not do (torch.compile would), and overlap of compute with communication (strategies add that apart).

Example::

    with OpCosts() as costs:
        loss = model(**batch).loss; loss.backward()
    costs.rows()                                  # [[dtype, flops, bytes, count], ...]
    roofline_seconds(costs.rows(), catalog["H100-80GB"], 0.6, 0.8)
"""
from __future__ import annotations

import re
from collections import Counter
from functools import cache
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from .catalog import Accelerator
from .moe import expert_ops

# The peak an op's inputs run at: fp32 matmuls run at the fp32 peak (torch leaves TF32 off for matmuls by
# default: torch.backends.cuda.matmul.allow_tf32 is False), 8-bit floats at fp8.
_PEAK_OF_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                  getattr(torch, "float8_e4m3fn", None): "fp8", getattr(torch, "float8_e5m2", None): "fp8"}


# Ops that only allocate (no byte is read or written until another op fills the memory).
_ALLOCATE_ONLY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh"})


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@cache
def _written_arguments(packet: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an op's schema says it writes, from its first overload that writes any:
    add_ writes self; _fused_adamw_ self, grads (it may unscale them in place: counted, an over-count of one
    gradient's bytes) and both moments; mul's out overload out, sort's values and indices. () when none does."""
    overloads = [getattr(packet, n) for n in packet.overloads()] if hasattr(packet, "overloads") else []
    for o in overloads:
        written = tuple((i, a.name) for i, a in enumerate(o._schema.arguments)
                        if a.alias_info is not None and a.alias_info.is_write)
        if written:
            return written
    return ()


def _written_bytes(packet: Any, args: tuple, kwargs: dict) -> int:
    """What an in-place op writes back: the arguments its schema mutates (its first argument when it names none)."""
    parts = [args[i] if i < len(args) else kwargs.get(name)
             for i, name in _written_arguments(packet) or ((0, "self"),)]
    return _nbytes(_tensors(parts))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _no_flops(*args: Any, **kwargs: Any) -> int:
    return 0


# Ops a device runs as one kernel that FlopCounterMode would still run as their generic decomposition (it decomposes
# every op without a FLOP formula that has one): silu_backward, in every SwiGLU MLP, became seven element-wise ops and
# six times its bytes. None of them multiplies matrices, so a zero-FLOP formula keeps each whole. (On torch 2.13 these
# are every aten op with both a CPU kernel and a CompositeImplicitAutograd one.)
_WHOLE = ("silu_backward", "mish_backward", "native_channel_shuffle")


@cache
def _kept_whole() -> dict:
    kept = {}
    for name in _WHOLE:
        packet = getattr(torch.ops.aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            kept[getattr(packet, overload)] = _no_flops
    return kept


# The fused attention kernels, forward and backward (aten's SDPA kernels and the trace's model of the target's,
# models/attention.py): their FLOPs grow with the square of the sequence length, every other op's with its tokens.
# The time at shorter lengths (estimate/lengths.py) scales the two apart. The math fallback and eager attention are
# ordinary matmuls and softmax, not told apart.
_ATTENTION_KERNELS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def _attention_kernel(func_packet) -> bool:
    name = str(func_packet)
    return "math" not in name and any(k in name for k in _ATTENTION_KERNELS)


# The matrix multiplies a row of ``OpCosts.unaligned_rows`` reads, with the positions of their two operands, and the
# multiple of elements a leading dimension must be for cuBLAS's aligned tensor-core kernels (16 bytes: NVIDIA's "Matrix
# Multiplication Background User's Guide", "Tensor Core Requirements"). A row-major operand's leading dimension is its
# row stride: a Linear's features (in, out, the vocabulary of a head), never its token count, which only sets how many
# rows there are; attention's scores have the sequence length as theirs. fp32 runs without tensor cores (TF32 is off
# for matmuls by default) and FP8 runs through _scaled_mm with dimensions torchao already requires aligned: neither
# is checked.
_MATMULS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}
_ALIGN_ELEMENTS = {"bf16": 8, "fp16": 8}


def _leading(t: torch.Tensor) -> int | None:
    """The leading dimension of a matrix (or a batch of them) as BLAS reads it: the stride of its last two dimensions
    that is not 1 (a transposed view is column-major); None when neither says (a 1 x 1 matrix)."""
    strides = [st for st, n in zip(t.stride()[-2:], t.shape[-2:]) if st != 1 and n != 1]
    return strides[0] if strides else None


def _unaligned_leading(name: str, args: tuple, out: Any) -> tuple[tuple[int, int, int], tuple[int, ...]] | None:
    """((M, N, K), the odd leading dimensions of its operands and output) of a matmul op with any, else None."""
    where = _MATMULS.get(name)
    if where is None or len(args) <= where[1]:
        return None
    a, b = args[where[0]], args[where[1]]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(out, torch.Tensor)) \
            or a.dim() < 2 or b.dim() < 2:
        return None
    align = _ALIGN_ELEMENTS.get(_PEAK_OF_DTYPE.get(a.dtype) or "")
    if align is None:
        return None
    odd = tuple(sorted({ld for ld in map(_leading, (a, b, out)) if ld is not None and ld % align}))
    return ((int(a.shape[-2]), int(b.shape[-1]), int(a.shape[-1])), odd) if odd else None


def _module_of(parents: set[str]) -> str:
    """The innermost module a ModuleTracker names, its layer index as ``*`` (``GPT2LMHeadModel.transformer.h.3.mlp``:
    ``transformer.h.*.mlp``), "" outside any. In backward the tracker may hold siblings: the name is a hint."""
    inner = max((p for p in parents if p != "Global"), key=lambda p: p.count("."), default="")
    return re.sub(r"\.\d+(?=\.|$)", ".*", inner.partition(".")[2] or inner)


class OpCosts(FlopCounterMode):
    """``FlopCounterMode`` that also keeps every op's (dtype, FLOPs, bytes moved), counted by signature, and the
    attention kernels' and the experts' grouped matmuls' rows apart (also in ``rows``). ``fp8_modules``: the module
    names (as its module tracker names them: the root's class name, then the path) whose matmuls FP8 training would
    run in float8; their FLOP-counted ops are also kept apart with their bytes read and written (``fp8_rows``)."""

    def __init__(self, fp8_modules: frozenset[str] = frozenset()) -> None:
        super().__init__(display=False, custom_mapping=_kept_whole())
        self.fp8_modules = fp8_modules
        self.fp8: Counter[tuple[str, int, int, int]] = Counter()
        self.counts: Counter[tuple[str, int, int]] = Counter()
        self.attention: Counter[tuple[str, int, int]] = Counter()
        self.experts: Counter[tuple[str, int, int]] = Counter()
        # (dtype, M, N, K, flops, odd leading dimensions) -> count, and the modules each was seen in.
        self.unaligned: Counter[tuple] = Counter()
        self.unaligned_modules: dict[tuple, set[str]] = {}
        self._expert_ops = frozenset(expert_ops())

    def _count_flops(self, func_packet, out, args, kwargs):
        formula = self.flop_registry.get(func_packet)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        if formula is not None:   # what FlopCounterMode._count_flops records, per module, with the formula run once
            for parent in set(self.mod_tracker.parents):
                self.flop_counts[parent][func_packet] += flops
        namespace, _, name = str(func_packet).partition(".")
        if namespace == "prim" or name in _ALLOCATE_ONLY:
            return out   # metadata queries (tensor.device) and allocations move nothing
        written_names = {n for _, n in _written_arguments(func_packet)}
        out_kwargs = {k: v for k, v in kwargs.items() if k in written_names}   # out=, values=/indices=: written
        given = _tensors(out_kwargs)
        inputs = list({id(t): t for t in _tensors((args, {k: v for k, v in kwargs.items() if k not in out_kwargs}))}
                      .values())   # x * x reads x once; mul(x, y, out=x) reads x and writes it
        outputs = _tensors(out)
        in_place = name.endswith("_")
        read_from = {_storage(t) for t in inputs}
        if not given and not in_place and outputs and all(_storage(t) in read_from for t in outputs):
            return out   # a view (view, transpose, expand, slice, _unsafe_view): an alias, no bytes moved
        # out= writes its tensors; an in-place op (add_, _foreach_mul_, _fused_adamw_) writes back what its schema
        # says it mutates; the others write their outputs.
        if given:
            written = _nbytes(given)
        elif in_place:
            written = _written_bytes(func_packet, args, kwargs)
        else:
            written = _nbytes(outputs)
        dtype = inputs[0].dtype if inputs else torch.float32
        key = (_PEAK_OF_DTYPE.get(dtype) or "fp32", flops, _nbytes(inputs) + written)
        self.counts[key] += 1
        if _attention_kernel(func_packet):
            self.attention[key] += 1
        if func_packet in self._expert_ops:
            self.experts[key] += 1
        found = _unaligned_leading(name, args, out) if flops else None
        if found:
            (m, n, k), odd = found
            unaligned = (key[0], m, n, k, flops, odd)
            self.unaligned[unaligned] += 1
            self.unaligned_modules.setdefault(unaligned, set()).add(_module_of(set(self.mod_tracker.parents)))
        if flops and self.fp8_modules and not self.fp8_modules.isdisjoint(self.mod_tracker.parents):
            self.fp8[(key[0], flops, _nbytes(inputs), written)] += 1
        return out

    def rows(self) -> list[list]:
        """[[dtype, flops, bytes, count], ...], largest bytes x count first (what a person reads first)."""
        return [[d, f, b, n] for (d, f, b), n in sorted(self.counts.items(), key=lambda kv: -kv[0][2] * kv[1])]

    def attention_rows(self) -> list[list]:
        """The attention kernels' rows of :meth:`rows`, as [[dtype, flops, bytes, count], ...]."""
        return [[d, f, b, n] for (d, f, b), n in sorted(self.attention.items(), key=lambda kv: -kv[0][2] * kv[1])]

    def fp8_rows(self) -> list[list]:
        """The matmuls of ``fp8_modules`` (a subset of :meth:`rows`), as [[dtype, flops, bytes read, bytes written,
        count], ...]: what estimate/fp8.py re-times at the FP8 peak."""
        return [[d, f, r, w, n] for (d, f, r, w), n in sorted(self.fp8.items(), key=lambda kv: -kv[0][1] * kv[1])]

    def unaligned_rows(self) -> list[list]:
        """The matmuls of :meth:`rows` with a leading dimension off the tensor cores' 16-byte alignment
        (``_ALIGN_ELEMENTS``), as [[dtype, M, N, K, flops, count, [odd leading dimensions], [modules]], ...], most FLOPs
        first: estimate/alignment.py says them."""
        return [[*key[:5], c, list(key[5]), sorted(self.unaligned_modules[key])]
                for key, c in sorted(self.unaligned.items(), key=lambda kv: -kv[0][4] * kv[1])]

    def expert_rows(self) -> list[list]:
        """The experts' grouped matmuls' rows of :meth:`rows` (estimate/moe.py): [[dtype, flops, bytes, count], ...]."""
        return [[d, f, b, n] for (d, f, b), n in sorted(self.experts.items(), key=lambda kv: -kv[0][2] * kv[1])]


def roofline_seconds(rows: list[list], acc: Accelerator, compute_efficiency: float,
                     bandwidth_efficiency: float) -> dict:
    """Seconds of the ops in ``rows`` on ``acc``, each the larger of its FLOPs and its bytes; the split says which
    ops bound the time. ``None`` seconds when the accelerator lacks a figure an op needs (no peak for its dtype,
    no bandwidth), with the reason."""
    bandwidth = acc.bandwidth_tb_s * 1e12 * bandwidth_efficiency
    if bandwidth <= 0:
        return {"seconds": None, "reason": f"{acc.name} has no memory bandwidth in the catalog"}
    compute_bound = memory_bound = 0.0
    flops = moved = 0
    for dtype, f, b, n in rows:
        by_bytes = b / bandwidth
        by_flops = 0.0
        if f:
            peak = acc.peak_flops(dtype)
            if not peak:
                return {"seconds": None, "reason": f"{acc.name} has no {dtype} peak in the catalog"}
            by_flops = f / (peak * compute_efficiency)
        if by_flops >= by_bytes:
            compute_bound += n * by_flops
        else:
            memory_bound += n * by_bytes
        flops += n * f
        moved += n * b
    return {"seconds": compute_bound + memory_bound, "compute_bound_seconds": compute_bound,
            "memory_bound_seconds": memory_bound, "flops": flops, "bytes": moved}
