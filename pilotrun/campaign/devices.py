"""Which accelerators each local campaign worker sees: one run per device on a node with several GPUs.

``assign_devices`` is pure: the inventory (from :func:`pilotrun.devices.query_devices`, the one
place that asks torch), the spec's ``train.device``, how many devices one run needs and the
launcher's own visibility variables in; the device slots out, each the value a worker gets in its
backend's visibility variable (``CUDA_VISIBLE_DEVICES`` on NVIDIA, ``HIP_VISIBLE_DEVICES`` on AMD
ROCm: :mod:`pilotrun.backends`), with the reason. A worker then sees its devices as ``cuda:0``…
and the spec's ``auto``/``cuda`` lands on them.

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

from .. import backends
from ..devices import DeviceInventory

# The runtimes whose devices a worker can be given (those with a visibility variable), for the messages.
_PARTITIONED = "/".join(b.label for b in backends.BACKENDS if b.visible_var)


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
        return backends.get(self.backend).visible_var if self.mode == DeviceMode.PER_RUN else None

    def env(self, slot: tuple[str, ...]) -> dict[str, str]:
        """The worker's visibility variable for one slot; ``{}`` when devices are not assigned."""
        var = self.env_var
        return {var: ",".join(slot)} if var else {}

    def to_dict(self) -> dict:
        return {"mode": str(self.mode), "backend": self.backend, "env_var": self.env_var, "reason": self.reason,
                "per_run": self.per_run, "slots": [list(s) for s in self.slots], "name": self.name,
                "memory_bytes": self.memory_bytes}


def assign_devices(inv: DeviceInventory, train_device: str, per_run: int = 1,
                   environ: Mapping[str, str] | None = None) -> DeviceSlots:
    """Split the visible accelerators into one slot of ``per_run`` devices per concurrent run.

    ``per_run`` is a run's processes, one device each: one for a run of pilotrun's loop, a program's launcher count
    (``torchrun --nproc-per-node 2``: two).
    ``environ`` is the launcher's environment (its visibility variables); ``{}`` when not given."""
    environ = environ if environ is not None else {}
    rt = inv.runtime
    var = rt.visible_var
    if var is None or inv.count < 1 or not rt.takes(train_device):
        why = ("train.device is cpu" if train_device == "cpu" else
               f"no {_PARTITIONED} device visible ({inv.backend})" if var is None or inv.count < 1
               else f"train.device is {train_device}")
        return DeviceSlots(DeviceMode.CPU, inv.backend, f"{why}: the runs share this machine's CPU")
    if ":" in train_device:  # cuda:N
        index = int(train_device.split(":")[1])
        name = inv.names[index] if index < inv.count else None
        memory = inv.total_memory_bytes[index] if index < len(inv.total_memory_bytes) else None
        return DeviceSlots(DeviceMode.SHARED, inv.backend,
                           f"train.device pins {train_device}: every run shares it (use auto or cuda for one device "
                           "per run)", name=name, memory_bytes=memory, shared_index=index)
    ids, source = rt.launcher_ids(inv.count, environ)
    groups = tuple(tuple(ids[i:i + per_run]) for i in range(0, len(ids) - per_run + 1, per_run))
    memories = list(inv.total_memory_bytes[:len(groups) * per_run])
    smallest = memories.index(min(memories)) if memories else None
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
    if devices.get("mode") != str(DeviceMode.PER_RUN) or not devices.get("env_var"):
        return dict(environ)
    return backends.get(devices["backend"]).worker_env(environ, slot)
