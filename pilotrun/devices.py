"""Every question about which accelerators exist goes through :func:`query_devices`.

Selection logic is tested on a CPU-only machine by patching that one function
(the pattern of Fabric's ``num_cuda_devices``). What differs between runtimes is a
:mod:`pilotrun.backends` object; the inventory names it (``DeviceInventory.runtime``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import backends


@dataclass(frozen=True)
class DeviceInventory:
    """What this process can see. ``backend`` is the name of a :mod:`pilotrun.backends` backend: cuda, rocm, mps
    or cpu."""

    backend: str
    count: int
    names: tuple[str, ...] = ()
    total_memory_bytes: tuple[int, ...] = ()
    versions: dict = field(default_factory=dict)

    @property
    def runtime(self) -> backends.Backend:
        """The backend object that ``backend`` names (what differs per runtime: counters, variables, streams)."""
        return backends.get(self.backend)


def query_devices() -> DeviceInventory:
    """The single place that asks torch which accelerators are visible: the first available backend's devices."""
    for rt in backends.BACKENDS:
        if rt.available():
            seen = rt.visible()
            return DeviceInventory(backend=rt.name, count=len(seen.names), names=seen.names,
                                   total_memory_bytes=seen.total_memory_bytes, versions=dict(seen.versions))
    raise AssertionError("the CPU backend is always available")  # pragma: no cover


def pick_device(requested: str) -> tuple[torch.device, str]:
    """Resolve train.device to a torch.device and say why, e.g. ('cuda:0', 'auto: 1 cuda device visible')."""
    inv = query_devices()
    rt = inv.runtime
    if requested == "auto":
        if rt.accelerator and rt.indexed:
            return rt.device(0), (f"auto: {inv.count} {inv.backend} device(s) visible, using the first "
                                  f"({inv.names[0]})")
        if rt.accelerator:
            return rt.device(0), f"auto: {inv.names[0]} visible"
        return torch.device("cpu"), "auto: no accelerator visible, running on CPU"
    dev = torch.device(requested)
    wanted = backends.for_device(dev)
    if not wanted.accelerator or isinstance(wanted, backends.Unlisted):
        return dev, f"requested {requested}"
    if rt.device_type != dev.type:
        raise DeviceUnavailable(wanted.unavailable(requested))
    if not rt.indexed:
        return dev, f"requested {requested}"
    index = dev.index or 0
    if index >= inv.count:
        raise DeviceUnavailable(f"train.device is {requested!r} but only {inv.count} device(s) are visible")
    return rt.device(index), f"requested {requested} ({inv.names[index]})"


class DeviceUnavailable(RuntimeError):
    """The spec asks for a device this machine does not have."""


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name ("NVIDIA H100 80GB HBM3"), or the device type."""
    inv = query_devices()
    if inv.names and device.type == inv.runtime.device_type:
        return inv.names[device.index or 0]
    return device.type


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
