"""The interface every device backend implements, with the defaults of a runtime that has nothing to offer.

A backend is what differs between accelerator runtimes (CUDA, ROCm, MPS, the CPU): whether it is there,
what its devices are called, how to wait for them, which memory counters it keeps, which
``torch.distributed`` backend and visibility variable it uses, its random streams and its library versions.
The defaults here are those of a device with no allocator counters, nothing to synchronise and no
visibility variable, so a backend overrides only what its runtime has.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

# A library version as torch reports it: a string ("12.4"), an int (cuDNN's 90100), or None where absent.
Version = str | int | None


@dataclass(frozen=True)
class Reading:
    """One memory counter: bytes (or a count), or ``None`` with the reason it cannot be read here."""

    value: int | None
    reason: str | None = None  # set exactly when value is None: what the row's not_measured says


@dataclass(frozen=True)
class Visible:
    """What a backend's runtime reports about its devices; :func:`pilotrun.devices.query_devices` builds the
    inventory from it."""

    names: tuple[str, ...] = ()                   # device 0, 1, ... as the runtime names them
    total_memory_bytes: tuple[int, ...] = ()      # per device; empty where the runtime does not say
    versions: dict[str, Version] = field(default_factory=dict)  # the runtime's libraries, for the inventory


class Backend:
    """One device runtime. Instances are registered in :data:`pilotrun.backends.BACKENDS`."""

    name: str = ""            # the inventory's backend name (DeviceInventory.backend): cuda, rocm, mps, cpu
    label: str = ""           # for people: "CUDA", "ROCm"
    device_type: str = ""     # the torch.device type of its devices ("cuda" for ROCm too: torch drives HIP as cuda)
    accelerator: bool = True  # False for the CPU only
    indexed: bool = False     # devices are numbered (type:N): one process per device, one campaign run per device
    allocator_counts: bool = False  # its allocator keeps peak counters; without them the live-tensor tracker counts
    pin_memory: bool = False  # whether a DataLoader feeding it should pin host memory
    dist_backend: str = "gloo"  # the torch.distributed backend its processes join
    visible_var: str | None = None  # the variable that chooses which devices a process sees
    # The variables a launcher's own selection may be written in, in the order the runtime applies them.
    inherited_visible: tuple[str, ...] = ()
    oom_words: tuple[str, ...] = ()  # words its allocator's out-of-memory message carries (lower case)

    # -- what exists (asked only by devices.query_devices) -------------------------------------------------------
    def built(self) -> bool:
        """Whether this torch build drives this runtime (for one device type driven by several, e.g. CUDA/HIP)."""
        return True

    def available(self) -> bool:
        """Whether its devices are usable in this process. Call :func:`pilotrun.devices.query_devices` instead:
        it is the one function that asks, and the one tests patch."""
        return False

    def visible(self) -> Visible:
        """Names, memory and versions of the devices this process sees (only when :meth:`available`)."""
        return Visible()

    def unavailable(self, requested: str) -> str:
        """What a spec asking for this runtime's device hears on a machine without it."""
        return f"train.device is {requested!r} but no {self.label} device is visible (use cpu or auto)"

    # -- devices ---------------------------------------------------------------------------------------------------
    def device(self, index: int = 0) -> torch.device:
        """The torch.device of its device ``index`` (the one LOCAL_RANK ``index`` uses when :attr:`indexed`)."""
        return torch.device(self.device_type, index) if self.indexed else torch.device(self.device_type)

    def current_device(self) -> torch.device | None:
        """Where torch puts a tensor when code names no device; None where that is the CPU."""
        return None

    def set_device(self, index: int) -> None:
        """Make device ``index`` this process's current one (a rank joining its process group)."""

    def ddp_device_ids(self, device: torch.device) -> list[int] | None:
        """DistributedDataParallel's ``device_ids`` for a module on ``device`` (None: the module's own device)."""
        return [device.index] if self.indexed and device.index is not None else None

    def synchronize(self, device: torch.device) -> None:
        """Wait until every kernel queued on ``device`` has run (a stage's time and peaks end here)."""

    # -- memory counters (docs/architecture.md, "Contracts": memory counters) -------------------------------------
    def reset_peaks(self, device: torch.device) -> None:
        """Start the allocator's peak counters again (every stage, at the same point)."""

    def peak_allocated(self, device: torch.device) -> Reading:
        return Reading(None, f"{self.device_type} has no allocator counter; the live-tensor tracker counts")

    def peak_reserved(self, device: torch.device) -> Reading:
        return Reading(None, f"{self.device_type} has no caching-allocator counter; see host_rss_peak_bytes")

    def alloc_retries(self, device: torch.device) -> Reading:
        """How often the allocator freed its cache and retried an allocation."""
        return Reading(None, f"{self.device_type} has no allocator retry counter")

    def device_used(self, device: torch.device) -> Reading:
        """Device memory in use by everyone now (the context and other processes included); sampled often."""
        return Reading(None, f"{self.device_type} has no device-level memory counter")

    def total_memory(self, device: torch.device) -> int | None:
        """The device's capacity in bytes, as its runtime reports it."""
        return None

    # -- random streams (checkpoint/state.py keeps them under these keys) -----------------------------------------
    def rng_state(self) -> dict[str, torch.Tensor]:
        """Every random stream of this runtime's devices, by checkpoint key."""
        return {}

    def set_rng_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put back the streams :meth:`rng_state` returned; other keys (another runtime's) are left alone."""

    # -- the lock ---------------------------------------------------------------------------------------------------
    def versions(self) -> dict[str, Version]:
        """The libraries this torch build carries for the runtime, by lock key; None where absent."""
        return {}

    # -- which devices a process sees ---------------------------------------------------------------------------
    def launcher_ids(self, count: int, environ: Mapping[str, str]) -> tuple[list[str], str]:
        """The ids to write in :attr:`visible_var` for devices 0..count-1 of this process, and where they came from.

        Under a launcher that already narrowed the devices (``CUDA_VISIBLE_DEVICES=2,3``), this process's device 0
        is the machine's device 2: a worker must get ``2``, not ``0``."""
        for var in self.inherited_visible:
            text = environ.get(var)
            if text:
                ids = [part.strip() for part in text.split(",") if part.strip()]
                if len(ids) >= count:
                    return ids[:count], f"${var}={text}"
        return [str(i) for i in range(count)], "all devices"

    def worker_env(self, environ: Mapping[str, str], ids: list[str] | tuple[str, ...]) -> dict[str, str]:
        """A worker's environment that shows it exactly the devices ``ids`` (the launcher's, otherwise)."""
        env = dict(environ)
        if self.visible_var:
            env[self.visible_var] = ",".join(ids)
        return env

    def takes(self, train_device: str) -> bool:
        """Whether a spec's ``train.device`` (auto, cpu, mps, cuda, cuda:N) lands on this runtime's devices."""
        return train_device == "auto" or train_device.split(":")[0] == self.device_type

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


class Unlisted(Backend):
    """A device type no registered backend drives (``meta``, or an accelerator pilotrun has no backend for): no
    counters, nothing to synchronise, gloo. Its messages name the device type."""

    def __init__(self, device_type: str) -> None:
        self.name = self.label = self.device_type = device_type
