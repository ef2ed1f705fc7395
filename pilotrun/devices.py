"""Every question about which accelerators exist goes through :func:`query_devices`.

Selection logic is tested on a CPU-only machine by patching that one function
(the pattern of Fabric's ``num_cuda_devices``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DeviceInventory:
    """What this process can see. ``backend`` is cuda, rocm, mps or cpu."""

    backend: str
    count: int
    names: tuple[str, ...] = ()
    total_memory_bytes: tuple[int, ...] = ()
    versions: dict = field(default_factory=dict)


def query_devices() -> DeviceInventory:
    """The single place that asks torch which accelerators are visible."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        props = [torch.cuda.get_device_properties(i) for i in range(n)]
        backend = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        return DeviceInventory(
            backend=backend,
            count=n,
            names=tuple(p.name for p in props),
            total_memory_bytes=tuple(int(p.total_memory) for p in props),
            versions={"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)},
        )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return DeviceInventory(backend="mps", count=1, names=("Apple MPS",))
    return DeviceInventory(backend="cpu", count=0, names=())


def pick_device(requested: str) -> tuple[torch.device, str]:
    """Resolve train.device to a torch.device and say why, e.g. ('cuda:0', 'auto: 1 cuda device visible')."""
    inv = query_devices()
    if requested == "auto":
        if inv.backend in ("cuda", "rocm"):
            return torch.device("cuda", 0), (f"auto: {inv.count} {inv.backend} device(s) visible, "
                                             f"using the first ({inv.names[0]})")
        if inv.backend == "mps":
            return torch.device("mps"), "auto: Apple MPS visible"
        return torch.device("cpu"), "auto: no accelerator visible, running on CPU"
    dev = torch.device(requested)
    if dev.type == "cuda":
        if inv.backend not in ("cuda", "rocm"):
            raise DeviceUnavailable(f"train.device is {requested!r} but no CUDA/ROCm device is visible "
                                    "(use cpu or auto)")
        index = dev.index or 0
        if index >= inv.count:
            raise DeviceUnavailable(f"train.device is {requested!r} but only {inv.count} device(s) are visible")
        return torch.device("cuda", index), f"requested {requested} ({inv.names[index]})"
    if dev.type == "mps" and inv.backend != "mps":
        raise DeviceUnavailable("train.device is 'mps' but MPS is not available here (use cpu or auto)")
    return dev, f"requested {requested}"


class DeviceUnavailable(RuntimeError):
    """The spec asks for a device this machine does not have."""


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name ("NVIDIA H100 80GB HBM3"), or the device type."""
    inv = query_devices()
    if device.type == "cuda" and inv.names:
        return inv.names[device.index or 0]
    return inv.names[0] if device.type == "mps" and inv.names else device.type


@dataclass(frozen=True)
class HostInventory:
    """This machine's CPU cores (those this process may run on) and the memory available now."""

    cpus: int
    memory_available_bytes: int


def query_host() -> HostInventory:
    """The single place that asks how many cores and how much host memory there are."""
    import os

    import psutil

    try:
        cpus = len(os.sched_getaffinity(0))  # a container's CPU set, not the host's
    except AttributeError:  # macOS
        cpus = os.cpu_count() or 1
    return HostInventory(cpus=cpus, memory_available_bytes=int(psutil.virtual_memory().available))
