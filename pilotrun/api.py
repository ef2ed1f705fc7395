"""Your own loop, same rows: measure a stage of any training program into the pilotrun ledger.

Example (a complete script)::

    import torch, pilotrun

    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters())
    batch = torch.randn(64, 512)

    with pilotrun.session("my-job", ledger="runs/ledger.sqlite") as run:
        for step in range(3):
            name = "first_step" if step == 0 else "steady_step"
            with run.stage(name, inputs={"micro_batch_size": 64}, track=[model, opt]) as st:
                loss = model(batch).pow(2).mean()
                loss.backward(); opt.step(); opt.zero_grad()
                st.check_finite(loss=loss)
        print(run.rows[1]["memory"]["peak_allocated_bytes"], st.row["seconds"])  # the measured steady_step

``pilotrun.stage(...)`` without a session opens one named after the script.
Each stage resets peaks and synchronises the device on entry and exit, keeps the
memory counters apart, and writes one row; a passing row's reason is its measured
summary (time and peaks). An exception inside the block writes a ``fail`` row whose
reason keeps the exception's own first line (an out-of-memory error also says which
memory, from its type) and is re-raised unchanged. ``check_finite`` marks the row
``fail`` and returns False; with ``raise_on_fail=True`` it raises :class:`StageFailed`
instead, so the loop stops there.

A stage of updates says how many and the time per update: call ``st.update_done()``
after each one (or pass ``inputs={"updates": N}``); the row reads "3 updates in 7.9 s
(2.6 s per update over the 2 after the first, whose memory was measured)". Measuring
memory slows every update it watches (on CPU and MPS the live-tensor tracker sees every
op, and the sampling thread of host RSS and device memory wakes every 10 ms), so a
session measures it on one update per stage name, the first: a stage entered once per
update measures its first entry only, a stage of several updates stops at its first
``update_done()``, and the rest are only timed (as pilotrun's own loop does), the time
per update taken over those; the allocator's own peak counters (CUDA) cost nothing and
run on every stage. ``with st.excluded("validation"):`` leaves a stretch out of the
stage (its time, host samples and allocator peaks) and the row says so.
"""
from __future__ import annotations

import atexit
import contextlib
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from . import backends
from .devices import query_devices
from .humanize import human_bytes, human_seconds
from .ledger.records import Failure, GateRow, RunKind, RunStatus, Verdict, new_run_id, now
from .ledger.store import Ledger
from .measure.meter import StageMeter, out_of_memory_reason
from .train.compile import UNTRACKED, StageCompile

# Words in an allocator's out-of-memory message that name an accelerator (torch's CUDA/HIP/MPS/XPU allocators).


class StageFailed(RuntimeError):
    """Raised by ``check_finite(..., raise_on_fail=True)``: the stage's row is written as ``fail`` (with
    ``failure`` and ``reason``) before this reaches the caller, who should stop the loop."""

    def __init__(self, stage: str, reason: str, failure: Failure) -> None:
        super().__init__(f"{stage}: {reason}")
        self.stage, self.reason, self.failure = stage, reason, failure


def peaks_phrase(memory: dict) -> str:
    """The measured memory counters, kept apart ("peak allocated 1.2 GiB, host RSS 3.1 GiB"); "" when none was."""
    labels = (("peak_allocated_bytes", "peak allocated"), ("peak_reserved_bytes", "peak reserved"),
              ("device_used_bytes", "device used"), ("host_rss_peak_bytes", "host RSS"))
    return ", ".join(f"{label} {human_bytes(memory[key])}" for key, label in labels if memory.get(key) is not None)


def measured_summary(seconds: float | None, memory: dict) -> str:
    """A passing row's reason: what was measured ("0.42 s; peak allocated 1.2 GiB, host RSS 3.1 GiB")."""
    peaks = peaks_phrase(memory)
    return "; ".join([f"{human_seconds(seconds)}" if seconds is not None else "time not measured"]
                     + ([peaks] if peaks else []))


def _updates_of(handle: StageHandle, inputs: dict) -> int | None:
    """The updates a stage spanned: those it counted with ``update_done()``, else ``inputs["updates"]``."""
    if handle.update_ends:
        return len(handle.update_ends)
    declared = inputs.get("updates")
    return declared if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0 else None


def _per_update(handle: StageHandle, seconds: float | None, updates: int) -> tuple[float | None, int]:
    """(mean seconds per update, how many updates it is taken over): over the updates after the tracked one where
    the stage counted them (the tracker slows the update it watches), else over all of them."""
    tracked = handle.tracked_updates or 0
    ends = [0.0, *handle.update_ends]
    each = [b - a for a, b in zip(ends, ends[1:])]
    if tracked and len(each) > tracked:
        rest = each[tracked:]
        return sum(rest) / len(rest), len(rest)
    return (seconds / updates if seconds is not None else None), updates


def _updates_phrase(updates: int, seconds: float | None, per_update: float | None, timed: int) -> str:
    """"3 updates in 7.9 s (2.6 s per update over the 2 after the first, whose memory was measured)"; "1 update in
    0.4 s"."""
    total = human_seconds(seconds) if seconds is not None else "time not measured"
    if updates == 1:
        return f"1 update in {total}"
    per = f"{human_seconds(per_update)} per update" if per_update is not None else "time per update not measured"
    over = f" over the {timed} after the first, whose memory was measured" if timed < updates else ""
    return f"{updates} updates in {total} ({per}{over})"


def _excluded_phrase(stretches: list[tuple[str, float]]) -> str:
    """"validation excluded (77.8 s)"; several of one kind are summed."""
    total: dict[str, list[float]] = {}
    for what, seconds in stretches:
        total.setdefault(what, []).append(seconds)
    return "; ".join(f"{what} excluded ({human_seconds(sum(t))}" + (f", {len(t)} times)" if len(t) > 1 else ")")
                     for what, t in total.items())


def _infer_device(track: Iterable) -> torch.device:
    for obj in track:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                return p.device
        if isinstance(obj, torch.Tensor):
            return obj.device
    return query_devices().runtime.current_device() or torch.device("cpu")


class StageHandle:
    """Yielded by ``stage()``: set the verdict yourself, or check values; ``row`` is filled on exit."""

    def __init__(self, name: str, meter: StageMeter | None = None) -> None:
        self.name = name
        self.verdict = Verdict.PASS
        self.reason = ""
        self.details: dict = {}
        self.failure: Failure | None = None
        self.row: dict = {}
        self.meter = meter                   # None: an inert handle (nothing is measured)
        self.update_ends: list[float] = []   # the stage's clock (pauses left out) at each update_done()
        self.tracked_updates: int | None = None  # updates whose memory was measured (None: none, or all of them)
        self.excluded_stretches: list[tuple[str, float]] = []  # (what, seconds) left out with excluded()
        self._paused_before = 0.0  # the meter's paused seconds when the current pause began

    def update_done(self) -> None:
        """One update of this stage ended: counted for the row's time per update; the first ends the memory
        measurement (tensor tracking, sampling: the rest are only timed)."""
        if self.meter is None:
            return
        self.update_ends.append(self.meter.elapsed())
        if self.meter.measuring_memory:
            self.meter.stop_memory()
            self.tracked_updates = len(self.update_ends)

    def pause(self) -> None:
        """Leave what follows out of the stage until :meth:`resume` (see :meth:`excluded`)."""
        if self.meter is not None and not self.meter.is_paused:
            self._paused_before = self.meter.paused_seconds
            self.meter.pause()

    def resume(self, what: str) -> None:
        """End a pause; ``what`` names the stretch on the row ("validation")."""
        if self.meter is not None and self.meter.is_paused:
            self.meter.resume()
            self.excluded_stretches.append((what, self.meter.paused_seconds - self._paused_before))

    @contextlib.contextmanager
    def excluded(self, what: str) -> Iterator[None]:
        """``with st.excluded("validation"): ...``: the block's time, host samples and allocator peaks are not the
        stage's; the row says what was left out and for how long."""
        self.pause()
        try:
            yield
        finally:
            self.resume(what)

    def warn(self, reason: str) -> None:
        if self.verdict != Verdict.FAIL:
            self.verdict, self.reason = Verdict.WARN, reason

    def fail(self, reason: str, failure: Failure = Failure.CHECK) -> None:
        self.verdict, self.reason, self.failure = Verdict.FAIL, reason, failure

    def check_finite(self, raise_on_fail: bool = False, **values) -> bool:
        """Fail the stage when any named value (loss=..., grad_norm=...) is inf or NaN: return False, or with
        ``raise_on_fail=True`` raise :class:`StageFailed` (the row is still written, as ``fail``)."""
        for key, value in values.items():
            v = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
            if not math.isfinite(v):
                self.fail(f"{key} is {v}", Failure.NON_FINITE)
                if raise_on_fail:
                    raise StageFailed(self.name, self.reason, Failure.NON_FINITE)
                return False
        return True


class Session:
    """One run row in the ledger; stages add gate rows to it."""

    def __init__(self, name: str, ledger: str | Path | None = None, rank: int | None = None,
                 world_size: int | None = None, *, run_id: str | None = None,
                 sink: Callable[[dict], None] | None = None) -> None:
        """``run_id``: add rows to that existing run (a pilot's, for ``pilotrun.program()``) instead of opening
        and closing a run of its own. ``sink``: hand each row to it instead of any ledger (no ledger is opened)."""
        self.name = name
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        self.rows: list[dict] = []
        self._sink = sink
        self._owns_run = run_id is None and sink is None
        self.run_id = run_id or new_run_id(name)
        self.ledger: Ledger | None = None if sink is not None else Ledger(ledger)
        self._measured: set[str] = set()  # stage names whose memory was measured (on their first update)
        if self._owns_run:
            assert self.ledger is not None
            self.ledger.start_run(self.run_id, name, RunKind.STAGE, spec_path=sys.argv[0] if sys.argv else None)
        self._closed = False

    @contextlib.contextmanager
    def stage(self, name: str, inputs: dict | None = None, track: Iterable = (),
              device: torch.device | str | None = None) -> Iterator[StageHandle]:
        track = list(track)
        dev = torch.device(device) if device is not None else _infer_device(track)
        started = now()
        error: BaseException | None = None
        # Measuring memory slows what it watches (the live-tensor tracker on CPU/MPS sees every op; the sampling
        # thread wakes every 10 ms): one update per stage name is measured, the first; the rest are only timed.
        measured_before = name in self._measured
        watch = StageCompile(track)
        untracked = watch.compiled and not backends.for_device(dev).allocator_counts
        meter = StageMeter(dev, track=track, tensor_tracking="manual" if measured_before or untracked else "stage",
                           measure_memory=not measured_before)
        if measured_before:
            meter.unmeasured_reason = (f"not measured: memory is measured on the first {name!r} stage's first "
                                       "update only (measuring slows every update it watches)")
        elif untracked:
            meter.unmeasured_reason = UNTRACKED
        self._measured.add(name)
        handle = StageHandle(name, meter)
        with meter:
            if not measured_before:
                handle.tracked_updates = 0  # measured until the first update_done(), or the whole stage
            try:
                yield handle
            except BaseException as exc:
                error = exc
        if handle.tracked_updates == 0:
            handle.tracked_updates = None  # the whole stage was measured: no update of it was only timed
        if error is not None and not isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit, StageFailed)):
            oom = out_of_memory_reason(error, dev)
            handle.fail(f"{name}: {oom or f'{type(error).__name__}: {error}'}",
                        Failure.OUT_OF_MEMORY if oom else Failure.ERROR)
            handle.details["traceback"] = "".join(traceback.format_exception(type(error), error,
                                                                              error.__traceback__))[-4000:]
        memory = meter.memory
        inputs = dict(inputs or {})
        reason = handle.reason or (measured_summary(meter.seconds, memory) if handle.verdict == Verdict.PASS else
                                   str(handle.verdict))
        timed_only = f"; memory measured on the first {name!r} stage only" if measured_before else ""
        reason += timed_only if not handle.reason and handle.verdict == Verdict.PASS else ""
        updates = _updates_of(handle, inputs)
        if updates is not None:
            inputs["updates"] = updates
            per_update, timed = _per_update(handle, meter.seconds, updates)
            handle.details.setdefault("seconds_per_update", per_update)
            handle.details.setdefault("updates_timed", timed)
            if handle.update_ends:
                ends = [0.0, *handle.update_ends]
                handle.details.setdefault("update_seconds", [b - a for a, b in zip(ends, ends[1:])])
            if not handle.reason and handle.verdict == Verdict.PASS:
                # A stage over several updates (the integrations' steady_step spans 3): its time is their total,
                # which read alone looked like one update's ("5.13 s"); say both, and over which updates.
                reason = _updates_phrase(updates, meter.seconds, per_update, timed) + (
                    f"; {peaks}" if (peaks := peaks_phrase(memory)) else "") + timed_only
        compiled, said, warning = watch.outcome(name, first=not measured_before)
        if compiled is not None:
            handle.details["compile"] = compiled
            reason += f"; {said}" if said and handle.verdict == Verdict.PASS else ""
            if warning and handle.verdict in (Verdict.PASS, Verdict.WARN):
                handle.verdict, reason = Verdict.WARN, f"{reason}; {warning}"
        if handle.excluded_stretches:
            handle.details["excluded"] = [{"what": w, "seconds": t} for w, t in handle.excluded_stretches]
            if handle.verdict == Verdict.PASS and not handle.reason:
                reason += "; " + _excluded_phrase(handle.excluded_stretches)
        row = GateRow(name, handle.verdict, reason, seconds=meter.seconds, started_at=started, ended_at=now(),
                      inputs={**(inputs or {}), "rank": self.rank, "world_size": self.world_size, "device": str(dev)},
                      memory=memory, rank=self.rank, world_size=self.world_size, details=handle.details,
                      failure=handle.failure).to_dict()
        self.write_row(row)
        handle.row = row
        if error is not None:
            raise error

    def write_row(self, row: dict) -> None:
        """One row to this session's run (or its sink)."""
        if self._sink is not None:
            self._sink(row)
        else:
            assert self.ledger is not None
            self.ledger.add_gate_row(self.run_id, row)
        self.rows.append(row)

    def note(self, text: str) -> None:
        if self.ledger is not None:
            self.ledger.add_note(self.run_id, text)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.ledger is not None:
                if self._owns_run:
                    self.ledger.end_run(self.run_id, RunStatus.of_pilot(self.rows))
                self.ledger.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self.rows:
            self.rows.append({"verdict": Verdict.FAIL})
        self.close()


_default: Session | None = None


def session(name: str | None = None, ledger: str | Path | None = None) -> Session:
    """Open a session (one run in the ledger). Use as a context manager, or call ``close()``."""
    global _default
    _default = Session(name or Path(sys.argv[0] or "script").stem or "script", ledger)
    return _default


def stage(name: str, inputs: dict | None = None, track: Iterable = (), device=None):
    """Measure one stage into the current session (opened on first use, closed at exit)."""
    global _default
    if _default is None or _default._closed:
        _default = session()
        atexit.register(_default.close)
    return _default.stage(name, inputs=inputs, track=track, device=device)
