"""Which accelerators each local campaign worker sees: one run per device on a node with several GPUs.

``assign_devices`` is pure: the inventory (from :func:`pilotrun.devices.query_devices`, the one
place that asks torch), the spec's ``train.device``, how many devices one run needs and the
launcher's own visibility variables in; the device slots out, each the value a worker gets in
``CUDA_VISIBLE_DEVICES`` (NVIDIA) or ``HIP_VISIBLE_DEVICES`` (AMD ROCm), with the reason. A
worker then sees its devices as ``cuda:0``… and the spec's ``auto``/``cuda`` lands on them.

Tests patch ``query_devices`` (or pass an inventory) to exercise this on a CPU-only machine.

Example::

    inv = DeviceInventory("cuda", 4, ("H100",) * 4, (80 << 30,) * 4)
    s = assign_devices(inv, "auto", environ={"CUDA_VISIBLE_DEVICES": "2,3,5,7"})
    s.mode, s.slots, s.env(s.slots[0])   # per-run, (('2',), ('3',), ('5',), ('7',)), {'CUDA_VISIBLE_DEVICES': '2'}
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from ..devices import DeviceInventory

# The variable each runtime reads to choose the visible devices, with its source:
# - CUDA: "CUDA_VISIBLE_DEVICES" (CUDA C Programming Guide, "CUDA Environment Variables").
# - ROCm: "HIP_VISIBLE_DEVICES" (ROCm docs, "GPU isolation techniques"); ROCm's torch also honours
#   CUDA_VISIBLE_DEVICES, applied after HIP's, so a ROCm worker gets HIP's and not an inherited CUDA one
#   (which would select again among the already selected devices).
VISIBLE_VAR = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}
# What a ROCm launcher's own selection may have been written in, in the order ROCm applies them.
_ROCM_INHERITED = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


class DeviceMode(str, Enum):
    """How the local workers share the accelerators."""

    CPU = "cpu"          # no accelerator in use: nothing changes (cores and host memory cap the runs)
    SHARED = "shared"    # the spec pins one device (train.device: cuda:N): every run uses it, memory caps them
    PER_RUN = "per-run"  # each run sees its own device(s) through the visibility variable

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class DeviceSlots:
    """The devices the campaign's workers get: ``slots[i]`` are the ids one run sees (PER_RUN only)."""

    mode: DeviceMode
    backend: str
    reason: str
    slots: tuple[tuple[str, ...], ...] = ()
    per_run: int = 1
    name: str | None = None          # the smallest device's name (the memory check uses the smallest)
    memory_bytes: int | None = None  # the smallest device's memory
    shared_index: int | None = None  # SHARED: the index the runs share

    @property
    def env_var(self) -> str | None:
        return VISIBLE_VAR.get(self.backend) if self.mode == DeviceMode.PER_RUN else None

    def env(self, slot: tuple[str, ...]) -> dict[str, str]:
        """The worker's visibility variable for one slot; ``{}`` when devices are not assigned."""
        var = self.env_var
        return {var: ",".join(slot)} if var else {}

    def to_dict(self) -> dict:
        return {"mode": str(self.mode), "backend": self.backend, "env_var": self.env_var, "reason": self.reason,
                "per_run": self.per_run, "slots": [list(s) for s in self.slots], "name": self.name,
                "memory_bytes": self.memory_bytes}


def _visible_ids(backend: str, count: int, environ: Mapping[str, str]) -> tuple[list[str], str]:
    """The ids to write for devices 0..count-1 of this process, and where they came from.

    Under a launcher that already narrowed the devices (``CUDA_VISIBLE_DEVICES=2,3``), this process's
    device 0 is the machine's device 2: a worker must get ``2``, not ``0``."""
    names = _ROCM_INHERITED if backend == "rocm" else ("CUDA_VISIBLE_DEVICES",)
    hip, cuda = environ.get("HIP_VISIBLE_DEVICES"), environ.get("CUDA_VISIBLE_DEVICES")
    if backend == "rocm" and hip and cuda:  # CUDA's list selects among HIP's: compose them
        hip_ids = [p.strip() for p in hip.split(",") if p.strip()]
        picks = [p.strip() for p in cuda.split(",") if p.strip()]
        if all(p.isdigit() and int(p) < len(hip_ids) for p in picks) and len(picks) >= count:
            return ([hip_ids[int(p)] for p in picks[:count]],
                    f"$HIP_VISIBLE_DEVICES={hip} then $CUDA_VISIBLE_DEVICES={cuda}")
    for var in names:
        text = environ.get(var)
        if text:
            ids = [part.strip() for part in text.split(",") if part.strip()]
            if len(ids) >= count:
                return ids[:count], f"${var}={text}"
    return [str(i) for i in range(count)], "all devices"


def assign_devices(inv: DeviceInventory, train_device: str, per_run: int = 1,
                   environ: Mapping[str, str] | None = None) -> DeviceSlots:
    """Split the visible accelerators into one slot of ``per_run`` devices per concurrent run.

    ``per_run`` is the spec's world size (processes, one device each); a campaign run is one process today.
    ``environ`` is the launcher's environment (its visibility variables); ``{}`` when not given."""
    environ = environ if environ is not None else {}
    if inv.backend not in VISIBLE_VAR or inv.count < 1 or train_device in ("cpu", "mps"):
        why = ("train.device is cpu" if train_device == "cpu" else
               f"no CUDA/ROCm device visible ({inv.backend})" if inv.backend not in VISIBLE_VAR or inv.count < 1
               else f"train.device is {train_device}")
        return DeviceSlots(DeviceMode.CPU, inv.backend, f"{why}: the runs share this machine's CPU")
    if train_device.startswith("cuda:"):
        index = int(train_device.split(":")[1])
        name = inv.names[index] if index < inv.count else None
        memory = inv.total_memory_bytes[index] if index < len(inv.total_memory_bytes) else None
        return DeviceSlots(DeviceMode.SHARED, inv.backend,
                           f"train.device pins {train_device}: every run shares it (use auto or cuda for one device "
                           "per run)", name=name, memory_bytes=memory, shared_index=index)
    ids, source = _visible_ids(inv.backend, inv.count, environ)
    groups = tuple(tuple(ids[i:i + per_run]) for i in range(0, len(ids) - per_run + 1, per_run))
    memories = list(inv.total_memory_bytes[:len(groups) * per_run])
    smallest = memories.index(min(memories)) if memories else None
    var = VISIBLE_VAR[inv.backend]
    each = "one device" if per_run == 1 else f"{per_run} devices (its world size)"
    reason = (f"{inv.count} {inv.backend} device(s) visible ({source}): each run gets {each} through ${var}"
              + ("" if groups else f"; not enough for one run, which needs {per_run}"))
    return DeviceSlots(DeviceMode.PER_RUN, inv.backend, reason, slots=groups, per_run=per_run,
                       name=inv.names[smallest] if smallest is not None else None,
                       memory_bytes=memories[smallest] if smallest is not None else None)


def worker_device_env(devices: Mapping, environ: Mapping[str, str],
                      slot: list[str] | tuple[str, ...]) -> dict[str, str]:
    """A worker's environment for one slot: the launcher's, with the visibility variable set to the slot.

    ``devices`` is a plan's ``devices`` entry (:meth:`DeviceSlots.to_dict`), as stored with the campaign."""
    env = dict(environ)
    var = devices.get("env_var")
    if devices.get("mode") != str(DeviceMode.PER_RUN) or not var:
        return env
    if devices.get("backend") == "rocm":  # HIP's selection alone; an inherited CUDA one would select again among it
        env.pop("CUDA_VISIBLE_DEVICES", None)
    env[var] = ",".join(slot)
    return env
