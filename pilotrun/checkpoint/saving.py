"""Writing one process's full training state: here and now, or behind the job from a host copy.

:func:`save_checkpoint` writes the live state and returns once the folder is complete. :func:`start_checkpoint`
first copies the state to host memory — pinned where the device's runtime pins (:func:`pilotrun.devices.
query_devices`), so the copy off an accelerator runs at the bus's speed; on a CPU a plain host copy — and returns as
soon as the copy is done: the job may change its weights from then on. A background thread writes the copy; the
checkpoint is complete only when :meth:`PendingSave.wait` returns, after its manifest is durable and the folder is
renamed into place. A process killed before that leaves only the ``.tmp-`` folder, and the previous checkpoint stays
the latest good one (``io.latest_checkpoint``).
"""
from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..devices import query_devices
from .digest import CHECKPOINT_DIGEST, Digest
from .io import AtomicFolder
from .state import capture_rng, model_state

SHARD_BYTES = 64 << 20  # shards are written in parallel, and each one's fsync overlaps the writing of the next


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def _shards(items: list, limit: int) -> list[list]:
    out: list[list] = []
    cur: list = []
    size = 0
    for key, value in items:
        n = _nbytes(value)
        if cur and size + n > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append((key, value))
        size += n
    if cur or not out:
        out.append(cur)
    return out


def _save_sharded(f: AtomicFolder, prefix: str, state: dict, extra: dict | None = None) -> None:
    """``prefix-00000-of-00003.pt`` ...; the first shard also carries ``extra`` (e.g. param_groups)."""
    groups = _shards(list(state.items()), SHARD_BYTES)
    for i, group in enumerate(groups):
        payload = {"entries": dict(group), **(extra if i == 0 and extra else {})}
        # torch.save through the folder's hashing file object: an OSError (ENOSPC) is chained to torch's error (as in
        # state.save_to), and every byte is hashed on its way to the file.
        f.submit(f"{prefix}-{i:05d}-of-{len(groups):05d}.pt", torch.save, payload)


@dataclass(frozen=True)
class Captured:
    """Everything a checkpoint holds, grouped as its files are: tensors by shard prefix, JSON documents by name."""

    meta: dict
    model: dict
    optimizer: dict            # the optimizer's per-parameter state
    param_groups: list
    rng_tensors: dict
    documents: dict[str, Any]  # file name -> JSON document


def capture(trainer, config: dict, lock_hash: str | None) -> Captured:
    """The trainer's state as references to its live objects (a synchronous save writes them before returning)."""
    rng_json, rng_tensors = capture_rng()
    meta = {"step": trainer.step, "config_hash": lock_hash}
    base = getattr(trainer, "base_identity", None)
    if base is not None:
        meta["base_identity"] = base  # the frozen base the adapter was trained on (not saved: rebuilt, compared)
    opt = trainer.optimizer.state_dict()
    documents = {"scheduler.json": trainer.scheduler.state_dict()}
    if trainer.scaler is not None:
        documents["scaler.json"] = trainer.scaler.state_dict()
    documents.update({"rng.json": rng_json, "trainer_state.json": trainer.state(), "config.json": config})
    return Captured(meta, model_state(trainer), opt["state"], opt["param_groups"], rng_tensors, documents)


def write_captured(folder: Path, state: Captured, digest: Digest = CHECKPOINT_DIGEST) -> AtomicFolder:
    """``state`` into ``folder`` atomically; returns the written folder's record."""
    with AtomicFolder(folder, "checkpoint", state.meta, digest) as f:
        _save_sharded(f, "model", state.model)
        _save_sharded(f, "optimizer", state.optimizer, {"param_groups": state.param_groups})
        f.submit("rng.pt", torch.save, state.rng_tensors)
        for name, document in state.documents.items():
            f.write_json(name, document)
    return f


def save_checkpoint(folder: Path, trainer, config: dict, lock_hash: str | None = None,
                    digest: Digest = CHECKPOINT_DIGEST) -> AtomicFolder:
    """Write the trainer's full state to ``folder`` atomically; returns the written folder's record."""
    return write_captured(folder, capture(trainer, config, lock_hash), digest)


# -- behind the job ---------------------------------------------------------------------------------------------

class _Staging:
    """Host buffers kept between one process's background saves, reused when the next state has the same storages:
    pinned memory is slow to allocate, and a fresh buffer's first touch faults in every page, so from the second save
    on the job waits for the copy alone. A buffer is reused only once the save that wrote from it is complete."""

    def __init__(self) -> None:
        self.buffers: list[torch.UntypedStorage] = []
        self.pinned = False
        self.writing: Future | None = None

    def take(self, pinned: bool) -> list[torch.UntypedStorage]:
        if self.writing is not None:
            wait_for([self.writing])  # its failure, if any, is its own waiter's to raise
            self.writing = None
        if pinned != self.pinned:
            self.buffers, self.pinned = [], pinned
        return self.buffers


_STAGING = _Staging()


def release_staging() -> None:
    """Free the kept host buffers (after the last background save of a process that saves no more), once the save
    writing from them is complete."""
    _STAGING.take(_STAGING.pinned)
    _STAGING.buffers = []


class _HostCopier:
    """Host copies of tensors, one per storage: views and tied weights keep sharing, as torch.save stores them."""

    def __init__(self, pinned: bool, reusable: list[torch.UntypedStorage]) -> None:
        self.pinned = pinned
        self.reusable = reusable
        self.used: list[torch.UntypedStorage] = []
        self.storages: dict[tuple, torch.UntypedStorage] = {}
        self.devices: set[torch.device] = set()

    def _buffer(self, nbytes: int, pin: bool) -> torch.UntypedStorage:
        i = len(self.used)
        if i < len(self.reusable) and self.reusable[i].nbytes() == nbytes and self.reusable[i].is_pinned() == pin:
            buf = self.reusable[i]
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).untyped_storage()
        self.used.append(buf)
        return buf

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        src = t.untyped_storage()
        key = (t.device, src.data_ptr(), src.nbytes())
        host = self.storages.get(key)
        if host is None:
            off_device = t.device.type != "cpu"
            pin = self.pinned and off_device
            host = self._buffer(src.nbytes(), pin)
            host.copy_(src, non_blocking=pin)  # the copies are queued; one synchronize per device waits for all
            if off_device:
                self.devices.add(t.device)
            self.storages[key] = host
        return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.shape, t.stride())

    def copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, dict):
            return {k: self.copy(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy(v) for v in obj)
        return copy.deepcopy(obj)  # numbers and strings; anything mutable is the job's to change after we return

    def wait(self) -> None:
        runtime = query_devices().runtime
        for device in self.devices:
            runtime.synchronize(device)


def host_copy(state: Captured, staging: _Staging = _STAGING) -> Captured:
    """``state`` with every tensor copied to host memory (pinned where this machine's accelerator runtime pins) and
    every document copied: nothing in it is the job's any more once this returns. The copy goes into ``staging``'s
    buffers where they fit, after the save that last wrote from them is complete."""
    pinned = query_devices().runtime.pin_memory
    copier = _HostCopier(pinned, staging.take(pinned))
    out = replace(state, meta=copier.copy(state.meta), model=copier.copy(state.model),
                  optimizer=copier.copy(state.optimizer), param_groups=copier.copy(state.param_groups),
                  rng_tensors=copier.copy(state.rng_tensors), documents=copier.copy(state.documents))
    copier.wait()
    staging.buffers = copier.used
    return out


def saves_behind(device: torch.device) -> bool:
    """Whether a save of state held on ``device`` is written behind the job: on this machine's accelerator, where the
    job need wait only for the copy to host memory. State on the CPU is written before the save returns: there the
    copy costs a good part of what the write does, doubles the state's memory, and the background write would take
    the cores the job computes on."""
    runtime = query_devices().runtime
    return runtime.accelerator and device.type == runtime.device_type


class PendingSave:
    """A checkpoint being written: ``blocking_seconds`` is what the job waited (the copy), :meth:`wait` returns the
    strategy's record (``{"files", "bytes", "manifest_sha256"}``, the last the digest of the manifest bytes written)
    once the folder is complete, or raises the writer's failure; ``total_seconds`` is then the time from the start
    until the folder was in place."""

    def __init__(self, folder: Path, blocking_seconds: float, future: Future, started: float,
                 behind: bool = True) -> None:
        self.folder = Path(folder)
        self.blocking_seconds = blocking_seconds
        self._future = future  # resolves to (record, perf_counter() when the folder was renamed into place)
        self._started = started
        self.total_seconds: float | None = None
        self.behind = behind  # written behind the job (the job waited for the copy only)

    @classmethod
    def finished(cls, folder: Path, record: dict, started: float) -> PendingSave:
        """A save written before it returned (started at ``perf_counter()`` ``started``): the job waited for all of
        it."""
        now = time.perf_counter()
        future: Future = Future()
        future.set_result((record, now))
        return cls(folder, now - started, future, started, behind=False)

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> dict:
        record, finished_at = self._future.result()
        self.total_seconds = finished_at - self._started
        return record


def start_checkpoint(folder: Path, trainer, config: dict, lock_hash: str | None = None,
                     digest: Digest = CHECKPOINT_DIGEST) -> PendingSave:
    """Copy the trainer's state to host memory, then write it on a background thread (:class:`PendingSave`).

    One at a time: a save started while the previous one is still being written waits for it first (its host buffers
    are the ones this copy reuses), and that wait counts as blocking time."""
    t0 = time.perf_counter()
    snapshot = host_copy(capture(trainer, config, lock_hash))  # waits for the previous background save first
    blocking = time.perf_counter() - t0

    def write() -> tuple[dict, float]:
        written = write_captured(folder, snapshot, digest)
        return ({"files": written.files, "bytes": written.total_bytes, "manifest_sha256": written.manifest_sha256},
                time.perf_counter())

    # A non-daemon thread: an interpreter that exits normally finishes the checkpoint first.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pilotrun-background-save")
    future = pool.submit(write)
    pool.shutdown(wait=False)
    _STAGING.writing = future
    return PendingSave(folder, blocking, future, t0)
