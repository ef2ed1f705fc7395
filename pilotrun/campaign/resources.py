"""How many campaign runs go at once on this machine: cores, host memory, accelerators and their memory.

``plan_parallel`` is pure: numbers in (what was asked, what the machine has, what one run
needs as a pilot measured it), a decision with its reasons out. The caller asks the machine
through :mod:`pilotrun.devices` and the ledger through :func:`pilot_memory`. Nothing is
guessed: without a pilot of the base spec, memory is "not checked" and the reason says how
to have it checked.

Example::

    plan = plan_parallel(4, cpus=2, host_available_bytes=20 << 30, accelerator=None, per_run=None)
    plan["parallel"], plan["reasons"]   # 2, ['2 CPU cores: ...']
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..gates.registry import job_memory_gates
from ..ledger.records import RunKind
from ..ledger.store import Ledger
from .devices import DeviceMode, DeviceSlots

# Share of the available host / accelerator memory parallel runs may take together; the rest is
# for the orchestrator, the page cache and the allocator's fragmentation.
HEADROOM = 0.9
# A campaign run does what the job's own gates measure (load, updates, eval, save, export, a restore): their peaks
# are what one of its processes needs.
RUN_STAGES = job_memory_gates()


@dataclass(frozen=True)
class PerRun:
    """What one run needed, measured by a pilot of the same spec."""

    host_bytes: int | None
    device_bytes: int | None
    source: str  # the pilot's run id


def pilot_memory(led: Ledger, config_hash: str) -> PerRun | None:
    """Peaks of the latest pilot whose config hash is the base spec's, or None when there is none."""
    for run_id in led.run_ids(RunKind.PILOT, config_hash):
        host, device = [], []
        for g in led.gate_records(run_id):
            mem = g.memory
            if g.gate not in RUN_STAGES:
                continue
            if mem.get("host_rss_peak_bytes"):
                host.append(mem["host_rss_peak_bytes"])
            dev = mem.get("peak_reserved_bytes") or mem.get("device_used_bytes")
            if dev:
                device.append(dev)
        if host or device:
            return PerRun(max(host) if host else None, max(device) if device else None, run_id)
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


class Limit(str, Enum):
    """What decided how many runs go at once (the plan's ``limited_by``)."""

    REQUESTED = "requested"          # --parallel itself: the machine has room for more
    CPU_CORES = "cpu-cores"
    HOST_MEMORY = "host-memory"
    DEVICES = "devices"              # one run per device (or per world size of devices)
    DEVICE_MEMORY = "device-memory"  # the pilot's measured peak against one device's memory

    def __str__(self) -> str:
        return self.value


def plan_parallel(requested: int, *, cpus: int, host_available_bytes: int, accelerator: tuple[str, int] | None,
                  per_run: PerRun | None, devices: DeviceSlots | None = None, processes: int = 1) -> dict:
    """Runs at once and torch threads per process. ``accelerator`` is (name, memory bytes) of the device the runs
    share.

    ``devices`` (from :func:`pilotrun.campaign.devices.assign_devices`) in mode per-run gives each run its own
    device(s) instead: the slots cap the runs, and the pilot's peak is checked against one device. ``processes``:
    how many processes one run starts (a program's launcher: torchrun --nproc-per-node N); each takes a core, its
    threads and the host memory one process of the pilot peaked at."""
    limits: list[tuple[int, str, Limit]] = []
    fine: list[str] = []  # checks that cap nothing (a run fits its own device)
    not_checked: list[str] = []
    own = devices is not None and devices.mode == DeviceMode.PER_RUN
    if own:
        assert devices is not None
        accelerator = None
        limits.append((len(devices.slots), devices.reason, Limit.DEVICES))
    elif accelerator is None:
        why = (f"{cpus} CPU core(s), {processes} processes per run: more CPU processes than cores only makes each "
               "slower" if processes > 1 else f"{cpus} CPU core(s): more CPU runs than cores only makes each slower")
        limits.append((cpus // processes, why, Limit.CPU_CORES))
    if per_run is None:
        not_checked.append("memory not checked: no pilot of the base spec in the ledger (run `pilotrun run BASE` "
                           "with the same ledger to have it checked)")
    else:
        if per_run.host_bytes:
            n = int(HEADROOM * host_available_bytes // (per_run.host_bytes * processes))
            each = f"one process peaked at {_gib(per_run.host_bytes)} x {processes} per run" if processes > 1 else \
                f"one run peaked at {_gib(per_run.host_bytes)}"
            limits.append((n, f"host memory: {_gib(host_available_bytes)} available, {each} in pilot "
                              f"{per_run.source}", Limit.HOST_MEMORY))
        if accelerator is not None:
            name, total = accelerator
            if per_run.device_bytes:
                n = int(HEADROOM * total // per_run.device_bytes)
                limits.append((n, f"{name}: {_gib(total)}, one run reserved {_gib(per_run.device_bytes)} in pilot "
                                  f"{per_run.source}; the runs share this device", Limit.DEVICE_MEMORY))
            else:
                not_checked.append(f"{name} memory not checked: pilot {per_run.source} has no device measurement "
                                   "(it ran on another device)")
        if own and devices is not None and devices.memory_bytes:
            # Each run has its devices to itself: the measured peak either fits one device or no run fits.
            if per_run.device_bytes:
                why = (f"{devices.name}: {_gib(devices.memory_bytes)} per device, one run reserved "
                       f"{_gib(per_run.device_bytes)} in pilot {per_run.source}; each run has its own")
                if per_run.device_bytes <= HEADROOM * devices.memory_bytes:
                    fine.append(f"{why}: fits")
                else:
                    limits.append((0, why, Limit.DEVICE_MEMORY))
            else:
                not_checked.append(f"{devices.name} memory not checked: pilot {per_run.source} has no device "
                                   "measurement (it ran on another device)")
    allowed = min([requested] + [n for n, _, _ in limits])
    binding = [(n, why, kind) for n, why, kind in limits if n < requested]
    reasons = [why for _, why, _ in binding]
    limited_by = min(binding, key=lambda b: b[0])[2] if binding else Limit.REQUESTED
    if allowed < 1:
        reasons.append("even one run may not fit; running one at a time")
        allowed = 1
    threads = max(1, cpus // (allowed * processes))
    plan: dict = {
        "requested": requested, "parallel": allowed, "threads_per_run": threads, "limited_by": str(limited_by),
        "reasons": reasons, "checked": [f"{why}: room for {max(n, 0)}" for n, why, _ in limits] + fine,
        "not_checked": not_checked,
        "text": (f"{allowed} run(s) at once" + (f" (asked {requested})" if allowed != requested else "")
                 + f", {threads} CPU thread(s) each" + (" of its processes" if processes > 1 else ""))}
    if devices is not None:
        plan["devices"] = devices.to_dict()
        if own:  # the slots the workers take turns on: as many as run at once
            plan["devices"]["slots"] = [list(s) for s in devices.slots[:allowed]]
    return plan
