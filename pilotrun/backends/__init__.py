"""What differs between device runtimes, one object per backend: CUDA, ROCm, Apple MPS and the CPU.

Every place that would test ``device.type == "cuda"`` or ``torch.version.hip`` asks a backend instead:

* which one exists: :func:`pilotrun.devices.query_devices` (the one function that asks torch, and the one tests
  patch) tries :data:`BACKENDS` in order and names the first available in ``DeviceInventory.backend``;
  ``DeviceInventory.runtime`` is its object;
* which one drives a given torch.device: :func:`for_device` (for ``cuda``, the torch build decides CUDA or ROCm;
  no device is asked);
* what it does: :class:`~pilotrun.backends.base.Backend` (synchronise, memory counters as readings with the
  reason when absent, the ``torch.distributed`` backend, the visibility variable, the device of a local rank,
  the random streams a checkpoint keeps, the library versions the lock records).

To add a runtime (XPU, say): one module with a :class:`Backend` subclass, and its line in :data:`BACKENDS`.

Example::

    rt = for_device(torch.device("cuda", 1))
    rt.name, rt.dist_backend, rt.visible_var     # ('cuda', 'nccl', 'CUDA_VISIBLE_DEVICES') on a CUDA build
    rt.peak_reserved(torch.device("cpu"))        # on the CPU backend: Reading(None, 'cpu has no caching-...')
"""
from __future__ import annotations

import torch

from .base import Backend, Reading, Unlisted, Version, Visible
from .cpu import CPU
from .cuda import CUDA, ROCm, hip_version
from .mps import MPS

# In the order query_devices tries them: the first available is this process's. The CPU is always available.
BACKENDS: tuple[Backend, ...] = (CUDA(), ROCm(), MPS(), CPU())

# Words an accelerator allocator's out-of-memory message carries: the registered runtimes', Intel's XPU (no
# backend yet) and the generic one.
OOM_WORDS: tuple[str, ...] = tuple(dict.fromkeys([w for b in BACKENDS for w in b.oom_words] + ["xpu", "gpu"]))


class UnknownBackend(LookupError):
    """An inventory or a stored plan names a backend no class implements."""


def names() -> list[str]:
    return [b.name for b in BACKENDS]


def get(name: str) -> Backend:
    """The backend an inventory names (``DeviceInventory.backend``)."""
    for b in BACKENDS:
        if b.name == name:
            return b
    raise UnknownBackend(f"no device backend {name!r}; known: {', '.join(names())}")


def for_type(device_type: str) -> Backend:
    """The backend that drives torch devices of this type in this build; :class:`Unlisted` for a type none does.

    Several backends may share a type (CUDA and ROCm are both ``cuda``): the torch build chooses, not the devices,
    so this asks nothing of them and works on a machine without any."""
    claims = [b for b in BACKENDS if b.device_type == device_type]
    built = [b for b in claims if b.built()]
    return (built or claims or [Unlisted(device_type)])[0]


def for_device(device: torch.device) -> Backend:
    """The backend of a torch.device (its memory counters, its synchronise, its process group)."""
    return for_type(device.type)


def numbered(train_device: str) -> bool:
    """Whether a spec's ``train.device`` may land on numbered accelerators (auto, cuda, cuda:N), one per process
    (what a cluster scheduler counts as a GPU); False for cpu and mps."""
    return any(b.indexed and b.takes(train_device) for b in BACKENDS)


def build_versions() -> dict[str, Version]:
    """Every backend's library versions, for the lock: the same keys on every machine, None where absent."""
    out: dict[str, Version] = {}
    for b in BACKENDS:
        for key, value in b.versions().items():
            if out.get(key) is None:
                out[key] = value
    return out


__all__ = ["BACKENDS", "CPU", "CUDA", "MPS", "OOM_WORDS", "Backend", "ROCm", "Reading", "UnknownBackend",
           "Unlisted", "Version", "Visible", "build_versions", "for_device", "for_type", "get", "hip_version",
           "names", "numbered"]
