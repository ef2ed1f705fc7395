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
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


def _storages(obj) -> list[torch.UntypedStorage]:
    out = []
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
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
            key = st.data_ptr() if st.nbytes() else id(st)
            if key in seen:
                continue
            seen.add(key)
            total += st.nbytes()
        out[cat] = total
    return out


class LiveTensorTracker(TorchDispatchMode):
    """``with LiveTensorTracker(track=[model, opt]) as t: ...``; then ``t.peak_bytes``."""

    def __init__(self, track: Iterable = (), device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
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
        if st.device.type != self.device_type or st in self._live:
            return
        n = st.nbytes()
        self._live[st] = n
        self.live_bytes += n
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

        def _freed(_ref, n=n, self_ref=weakref.ref(self)):
            me = self_ref()
            if me is not None:
                me.live_bytes -= n

        self._refs.append(weakref.ref(st, _freed))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for st in _storages(out):
            self._add(st)
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        # Drop the callbacks: storages freed later must not touch a finished tracker.
        self._refs.clear()
        return result
