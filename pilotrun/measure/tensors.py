"""Peak live tensor bytes on CPU, where there is no allocator counter to read.

A ``TorchDispatchMode`` sees every tensor an op produces; each new storage is
counted once and subtracted when its last reference dies (a weakref callback on
the ``UntypedStorage``, whose Python object torch keeps alive with the storage).
Storages that existed before tracking started (parameters, gradients, optimizer
state) are registered up front so the peak is the whole live set, not just what
the stage allocated. This mirrors what ``torch.cuda.max_memory_allocated`` reports
on a GPU, minus allocator rounding.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


def _storages(obj) -> list[torch.UntypedStorage]:
    out = []
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            if hasattr(leaf, "to_local"):  # a DTensor (FSDP2): this rank's shard is what it holds
                leaf = leaf.to_local()
            try:
                out.append(leaf.untyped_storage())
            except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
                pass
    return out


def state_tensors(objs: Iterable) -> dict[str, list[torch.Tensor]]:
    """Tensors held by modules and optimizers, by category."""
    cats: dict[str, list[torch.Tensor]] = {"parameters": [], "gradients": [], "buffers": [], "optimizer_state": []}
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                cats["parameters"].append(p)
                if p.grad is not None:
                    cats["gradients"].append(p.grad)
            cats["buffers"].extend(obj.buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            for st in obj.state.values():
                cats["optimizer_state"].extend(v for v in st.values() if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor):
            cats.setdefault("other", []).append(obj)
    return cats


def category_bytes(objs: Iterable) -> dict[str, int]:
    """Bytes per category, each storage counted once (tied weights are not double counted)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for cat, tensors in state_tensors(objs).items():
        total = 0
        for st in _storages(tensors):
            try:
                key = st.data_ptr() if st.nbytes() else id(st)
            except RuntimeError:  # a storage FSDP freed (resized to zero)
                continue
            if key in seen:
                continue
            seen.add(key)
            total += st.nbytes()
        out[cat] = total
    return out


class LiveTensorTracker(TorchDispatchMode):
    """``with LiveTensorTracker(track=[model, opt]) as t: ...``; then ``t.peak_bytes``."""

    def __init__(self, track: Iterable = (), device_type: str = "cpu", fake: bool = False,
                 round_to: int = 0) -> None:
        super().__init__()
        self.device_type = device_type
        # Under FakeTensorMode storages live on "meta": count them as the device they stand for.
        self.fake = fake
        # CUDA's caching allocator rounds every block up to 512 B: the estimator counts that way.
        self.round_to = round_to
        self.tensors = 0
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: list = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.register(track)
        self.baseline_bytes = self.live_bytes
        self.peak_bytes = self.live_bytes

    def register(self, objs: Iterable) -> None:
        for tensors in state_tensors(objs).values():
            for st in _storages(tensors):
                self._add(st)

    def _add(self, st: torch.UntypedStorage) -> None:
        kind = st.device.type
        if (kind != self.device_type and not (self.fake and kind == "meta")) or st in self._live:
            return
        n = st.nbytes()
        if self.round_to and n:
            n = -(-n // self.round_to) * self.round_to
        self.tensors += 1
        self._live[st] = n
        self.live_bytes += n
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

        me_ref = weakref.ref(self)

        def _freed(_ref, n=n, self_ref=me_ref):
            me = self_ref()
            if me is not None:
                me.live_bytes -= n

        self._refs.append(weakref.ref(st, _freed))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view of an input (a dataset row, a slice) allocates nothing: skip storages the op was given.
        given = {id(st) for st in _storages((args, kwargs))}
        for st in _storages(out):
            if id(st) not in given:
                self._add(st)
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        # Drop the callbacks: storages freed later must not touch a finished tracker.
        self._refs.clear()
        return result


class CategoryTracker(TorchDispatchMode):
    """Live storage bytes by category, and the breakdown at the peak: what the estimator needs.

    Categories: ``parameters``, ``buffers``, ``gradients`` (re-labelled when autograd
    accumulates them into ``.grad``), ``optimizer`` (everything ``optimizer.step()``
    allocates: its state and its foreach temporaries, which shard alike under FSDP),
    ``weight_casts`` (autocast's bf16/fp16 copies of parameters) and ``activations``
    (everything else forward and backward allocate). Cheaper per op than
    ``MemTracker``, whose cost grows with the number of modules. Peaks are kept both
    unrounded and with every storage rounded up to ``round_to`` bytes.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 fake: bool = False, round_to: int = 512) -> None:
        super().__init__()
        self.fake = fake
        self.round_to = round_to
        self.model = model
        self.optimizer = optimizer
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [category, bytes, rounded]
        self._refs: list = []
        self.live = {"parameters": 0, "buffers": 0, "gradients": 0, "optimizer": 0, "weight_casts": 0,
                     "activations": 0}
        self.live_bytes = self.live_rounded = 0
        self.peak_bytes = self.peak_rounded = 0
        self.peak_breakdown: dict[str, int] = dict(self.live)
        self.tensors = 0
        self.step_peak = 0  # the largest live total while optimizer.step() ran
        self._phase: str | None = None
        self._handles: list = []
        for p in model.parameters():
            self._register(p, "parameters")
            if p.grad is not None:
                self._register(p.grad, "gradients")
        for b in model.buffers():
            self._register(b, "buffers")
        if optimizer is not None:
            for st in optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        self._register(v, "optimizer")
        self.baseline_bytes = self.live_bytes

    # -- bookkeeping --------------------------------------------------------------------
    def _register(self, t: torch.Tensor, category: str) -> None:
        for st in _storages(t):
            rec = self._records.get(st)
            if rec is None:
                self._add(st, category)
            elif rec[0] != category:
                self.live[rec[0]] -= rec[1]
                self.live[category] += rec[1]
                rec[0] = category

    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        kind = st.device.type
        # Where a trace's tensors can live (the CPU, a GPU in the device tests, meta when fake), not a runtime's
        # behaviour: nothing here asks a backend.
        if kind not in ("cpu", "cuda") and not (self.fake and kind == "meta"):
            return
        n = st.nbytes()
        r = -(-n // self.round_to) * self.round_to if self.round_to and n else n
        rec = [category, n, r]
        self._records[st] = rec
        self.live[category] += n
        self.live_bytes += n
        self.live_rounded += r
        self.tensors += 1
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_breakdown = dict(self.live)
        if self.live_rounded > self.peak_rounded:
            self.peak_rounded = self.live_rounded
        if self._phase == "optimizer" and self.live_bytes > self.step_peak:
            self.step_peak = self.live_bytes

        me_ref = weakref.ref(self)

        def _freed(_ref, rec=rec, self_ref=me_ref):
            me = self_ref()
            if me is not None:
                me.live[rec[0]] -= rec[1]
                me.live_bytes -= rec[1]
                me.live_rounded -= rec[2]

        self._refs.append(weakref.ref(st, _freed))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = self._phase or "activations"
        given = {id(st) for st in _storages((args, kwargs))}
        if func is torch.ops.aten._to_copy.default and args and isinstance(args[0], torch.Tensor):
            # autocast's lower-precision copy of a weight: kept for backward, gone under FSDP2's
            # mixed-precision policy (which gathers the parameters in that dtype instead)
            src = self._records.get(args[0].untyped_storage()) if args[0].device.type != "meta" or self.fake else None
            if src is not None and src[0] == "parameters":
                category = "weight_casts"
        for st in _storages(out):
            if st not in self._records and id(st) not in given:
                self._add(st, category)
        return out

    # -- hooks that name what a storage is ------------------------------------------------
    def __enter__(self):
        for p in self.model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda p: self._register(p.grad, "gradients")))
        if self.optimizer is not None:
            def pre(opt, args, kwargs):
                self._phase = "optimizer"

            def post(opt, args, kwargs):
                self._phase = None
                for st_ in opt.state.values():
                    for v in st_.values():
                        if isinstance(v, torch.Tensor):
                            self._register(v, "optimizer")

            self._handles.append(self.optimizer.register_step_pre_hook(pre))
            self._handles.append(self.optimizer.register_step_post_hook(post))
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        result = super().__exit__(*exc)
        self._refs.clear()
        return result
