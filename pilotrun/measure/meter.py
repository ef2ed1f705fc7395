"""One measured stage: peaks reset and the device synchronised at the same points everywhere.

Counters are kept apart and never added (docs/architecture.md, "Contracts": memory counters):

* ``peak_allocated_bytes`` – peak bytes held by live tensors (CUDA/ROCm allocator
  ``max_memory_allocated``; on CPU the :class:`LiveTensorTracker`).
* ``peak_reserved_bytes`` – peak bytes the caching allocator held (CUDA/ROCm only).
* ``device_used_bytes`` – peak device memory in use by everyone, sampled from
  ``mem_get_info`` (includes the CUDA context and other processes).
* ``host_rss_peak_bytes`` – peak resident set size of this process, sampled.

The device's counters are its backend's (:mod:`pilotrun.backends`, ``for_device``). A counter
that cannot be read on this device is ``None`` and its reason is in ``not_measured``: never a
silent zero.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable

import psutil
import torch

from .. import backends
from .tensors import LiveTensorTracker, category_bytes

SAMPLE_INTERVAL_S = 0.01


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (its backend's synchronise; nothing on the CPU)."""
    backends.for_device(device).synchronize(device)


class _Sampler(threading.Thread):
    """Samples host RSS (and device-level used bytes where the backend reads them) until stopped."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(daemon=True, name="pilotrun-memory-sampler")
        self.device = device
        self.backend = backends.for_device(device)
        self.proc = psutil.Process()
        self.rss_peak = self.proc.memory_info().rss
        self.device_used_peak: int | None = None
        self.device_used_reason: str | None = None  # why device_used_peak is None
        self.paused = False  # a stretch the stage excludes (an evaluation inside a training stage): not sampled
        self._stop_event = threading.Event()

    def sample(self) -> None:
        if self.paused:
            return
        rss = self.proc.memory_info().rss
        if rss > self.rss_peak:
            self.rss_peak = rss
        used = self.backend.device_used(self.device)
        if used.value is None:
            self.device_used_reason = used.reason
        elif self.device_used_peak is None or used.value > self.device_used_peak:
            self.device_used_peak = used.value

    def run(self) -> None:
        while not self._stop_event.wait(SAMPLE_INTERVAL_S):
            self.sample()

    def stop(self) -> None:
        """Stop sampling (a last sample first); once: a stage may end its sampling before it ends."""
        if self._stop_event.is_set():
            return
        self._stop_event.set()
        self.join()
        self.paused = False
        self.sample()


class StageMeter:
    """Measure a stage: ``with StageMeter(device, track=[model, opt]) as m: ...``; then ``m.memory``, ``m.seconds``.

    ``tensor_tracking`` (CPU only) chooses whether the dispatch-mode tracker runs for
    the whole stage (``"stage"``) or only inside ``with m.track_tensors():`` blocks
    (``"manual"``), so that timed updates are not slowed by tracking. ``measure_memory=False``:
    no sampling thread and no state count (host RSS, the device's used bytes and the tracked
    objects' bytes are then not measured: a thread waking every 10 ms slowed a 2-core CPU update
    by a third). ``stop_memory()`` ends a stage's sampling
    and tracking early (after its first update: the rest is only timed). ``unmeasured_reason`` is
    what the memory says of a counter nothing measured.

    ``pause()``/``resume()`` leave a stretch out of the stage (an evaluation or a save inside a
    training stage): its time is not counted, the host is not sampled, and the allocator's peaks of
    the stretch are dropped (the peak before it is kept, the counters are reset after it).
    """

    def __init__(self, device: torch.device, track: Iterable = (), tensor_tracking: str = "stage",
                 measure_memory: bool = True) -> None:
        self.device = device
        self.measure_memory = measure_memory
        self.backend = backends.for_device(device)
        self.track = list(track)
        self.tensor_tracking = tensor_tracking
        self.memory: dict = {}
        self.seconds = 0.0
        self.state_before: dict | None = None
        self._tracked_peak: int | None = None
        self._tracker: LiveTensorTracker | None = None
        self._sampler: _Sampler | None = None
        self._stack = contextlib.ExitStack()
        self.unmeasured_reason: str | None = None  # None: "no block of this stage was tracked" / "not sampled"
        self.paused_seconds = 0.0
        self._paused_at: float | None = None
        self._carried: dict[str, int] = {}  # the allocator's peaks before a pause

    @property
    def uses_tensor_tracker(self) -> bool:
        return not self.backend.allocator_counts

    @contextlib.contextmanager
    def track_tensors(self):
        """Count live tensors inside this block (CPU/MPS); a no-op where the allocator counts."""
        if not self.uses_tensor_tracker or self._tracker is not None:
            yield
            return
        tracker = LiveTensorTracker(self.track, device_type=self.device.type)
        with tracker:
            yield
        peak = tracker.peak_bytes
        self._tracked_peak = peak if self._tracked_peak is None else max(self._tracked_peak, peak)

    def stop_memory(self) -> None:
        """End the stage's tensor tracker and sampling now (their peaks so far are the stage's); the rest of the
        stage is only timed (the allocator's own peak counters, which cost nothing, still run)."""
        if self._tracker is not None:
            self._stack.close()
            self._tracked_peak = self._tracker.peak_bytes
            self._tracker = None
        if self._sampler is not None:
            self._sampler.stop()

    @property
    def measuring_memory(self) -> bool:
        """Whether the tensor tracker or the sampler is still watching this stage."""
        return self._tracker is not None or (self._sampler is not None and self._sampler.is_alive())

    def elapsed(self) -> float:
        """Seconds since the stage began, paused stretches left out."""
        now = time.perf_counter()
        paused = self.paused_seconds + (now - self._paused_at if self._paused_at is not None else 0.0)
        return now - self._t0 - paused

    @property
    def is_paused(self) -> bool:
        return self._paused_at is not None

    def pause(self) -> None:
        if self._paused_at is not None:
            return
        synchronize(self.device)
        for key, reading in (("peak_allocated_bytes", self.backend.peak_allocated(self.device)),
                             ("peak_reserved_bytes", self.backend.peak_reserved(self.device))):
            if self.backend.allocator_counts and reading.value is not None:
                self._carried[key] = max(reading.value, self._carried.get(key, 0))
        if self._sampler is not None and self._sampler.is_alive():
            self._sampler.sample()
            self._sampler.paused = True
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is None:
            return
        synchronize(self.device)
        self.paused_seconds += time.perf_counter() - self._paused_at
        self._paused_at = None
        self.backend.reset_peaks(self.device)
        if self._sampler is not None:
            self._sampler.paused = False

    def register(self, objs: Iterable) -> None:
        """Count tensors that appeared without passing through dispatch (e.g. memory-mapped weights)."""
        if self._tracker is not None:
            self._tracker.register(objs)
        self.track.extend(objs)

    def __enter__(self) -> StageMeter:
        synchronize(self.device)
        self.state_before = category_bytes(self.track) if self.measure_memory else None
        self.backend.reset_peaks(self.device)
        if self.measure_memory:
            self._sampler = _Sampler(self.device)
            self._sampler.start()
        if self.uses_tensor_tracker and self.tensor_tracking == "stage":
            self._tracker = LiveTensorTracker(self.track, device_type=self.device.type)
            self._stack.enter_context(self._tracker)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            synchronize(self.device)
        except Exception:  # a failed kernel can poison the sync; the row still gets written
            pass
        self.seconds = self.elapsed()
        if self._paused_at is not None:  # ended inside an excluded stretch
            self.paused_seconds += time.perf_counter() - self._paused_at
            self._paused_at = None
            if self._sampler is not None:
                self._sampler.paused = False
        self._stack.close()
        if self._tracker is not None:
            self._tracked_peak = self._tracker.peak_bytes
        if self._sampler is not None:
            self._sampler.stop()
        self.memory = self._collect()
        return None

    def _device_used(self) -> backends.Reading:
        """The sampled peak of the device's used bytes, or why there is none."""
        if self._sampler is None or self._sampler.device_used_peak is None:
            reason = self._sampler.device_used_reason if self._sampler else None
            return backends.Reading(None, reason or self.unmeasured_reason or "not sampled")
        return backends.Reading(self._sampler.device_used_peak)

    def _collect(self) -> dict:
        not_measured: dict[str, str] = {}
        mem: dict = {
            "peak_allocated_bytes": None,
            "peak_reserved_bytes": None,
            "device_used_bytes": None,
            "host_rss_peak_bytes": int(self._sampler.rss_peak) if self._sampler else None,
        }
        if self._sampler is None:
            not_measured["host_rss_peak_bytes"] = self.unmeasured_reason or "not sampled"
        rt, dev = self.backend, self.device
        readings = {"peak_reserved_bytes": rt.peak_reserved(dev), "device_used_bytes": self._device_used()}
        if rt.allocator_counts:
            mem["source"] = f"{rt.device_type}-allocator"
            readings["peak_allocated_bytes"] = rt.peak_allocated(dev)
            for key, before in self._carried.items():  # the peak before a paused stretch, where it was higher
                after = readings[key].value
                if after is not None and before > after:
                    readings[key] = backends.Reading(before)
            retries = rt.alloc_retries(dev)
            if retries.value is not None:
                mem["alloc_retries"] = retries.value
        else:
            mem["source"] = f"{dev.type}-live-tensors"
            tracked = self._tracked_peak  # the live-tensor tracker's, where the allocator keeps no peak
            readings["peak_allocated_bytes"] = (backends.Reading(tracked) if tracked is not None else
                                                backends.Reading(None, self.unmeasured_reason or
                                                                 "no block of this stage was tracked"))
        for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes"):
            mem[key] = readings[key].value
            if readings[key].value is None:
                not_measured[key] = readings[key].reason or "not read"
        if self.state_before is not None:
            try:
                state_after = category_bytes(self.track)
            except Exception:
                state_after = {}
            mem["state_bytes_before"] = self.state_before
            mem["state_bytes_after"] = state_after
        if not_measured:
            mem["not_measured"] = not_measured
        return mem


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        "out of memory" in text.lower() or isinstance(exc, MemoryError) or "DefaultCPUAllocator: can't allocate" in text
    )


def oom_detail(device: torch.device) -> str:
    """'at 78.2 GiB reserved of 79.1 GiB' where the backend counts reserved memory (CUDA); host figures on CPU."""
    rt = backends.for_device(device)
    reserved = rt.peak_reserved(device).value
    total = rt.total_memory(device) if reserved is not None else None
    if reserved is not None and total is not None:
        return f"out of memory at {reserved / 2**30:.1f} GiB reserved of {total / 2**30:.1f} GiB"
    vm = psutil.virtual_memory()
    return f"out of host memory ({vm.available / 2**30:.1f} GiB available of {vm.total / 2**30:.1f} GiB)"


# Words an accelerator allocator's message carries (CUDA and ROCm's HIP, Apple's MPS, Intel's XPU).
ACCELERATOR_WORDS = backends.OOM_WORDS


def out_of_memory_reason(error: BaseException, device: torch.device) -> str | None:
    """For an out-of-memory exception, which memory ran out and what it held, with the exception's own words;
    None for any other exception.

    The type decides first (``torch.OutOfMemoryError`` is the accelerator's allocator, ``MemoryError`` the
    host's), then the allocator's message: a "CUDA out of memory" raised while the stage measured the CPU is
    still the accelerator's, not the host's."""
    if not is_oom(error):
        return None
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    if len(first) > 300:
        first = first[:297] + "..."
    accelerator = isinstance(error, torch.OutOfMemoryError) or (
        not isinstance(error, MemoryError) and "DefaultCPUAllocator" not in text
        and any(w in text.lower() for w in ACCELERATOR_WORDS))
    rt = backends.for_device(device)
    if accelerator and rt.allocator_counts:
        where = oom_detail(device).replace("out of memory", "out of accelerator memory", 1)
    elif accelerator and not rt.accelerator:
        where = ("out of accelerator memory (its counters not measured: the stage measured the cpu; pass device= "
                 "or track= the model)")
    elif accelerator:
        where = f"out of accelerator memory (not measured: no reserved-memory counter on {device.type})"
    else:
        where = oom_detail(torch.device("cpu"))
    return f"{where}: {type(error).__name__}: {first}" if first else f"{where}: {type(error).__name__}"
