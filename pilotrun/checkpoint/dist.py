"""Checkpoints of a job spread over several processes, with ``torch.distributed.checkpoint``.

Each rank writes its shards (DCP) and its own RNG streams and data position; rank 0 writes
the shared pieces (scheduler, scaler, config), then — after every rank is done — hashes every
file into the manifest and renames the folder into place, so a checkpoint is either whole
or absent, as in one process. On accelerators the shards are written behind the job by DCP's
``async_save`` (:func:`start_distributed`): the job waits for the copy to host memory only.
The DCP folder can be read without the original processes:
:func:`convert` turns it into one file (``.pt`` for ``torch.load(weights_only=True)``, or
``.safetensors``).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from ..devices import query_devices
from .digest import CHECKPOINT_DIGEST
from .io import MANIFEST, CheckpointError, fsync_dir, private_mkdir, publish_mode, read_manifest
from .pinned import pinned, require_known
from .saving import PendingSave
from .state import capture_rng, load_state_json, load_torch_file, restore_rng
from .statefiles import check_config, check_trainer_state, job_hash
from .trust import LoadPolicy, sha256_hex
from .writer import HashingWriter


def _dcp_call(folder: Path, fn, *args, **kwargs):
    """A ``torch.distributed.checkpoint`` read of a pinned view of an admitted, known folder (:func:`require_known`
    first: it unpickles ``dcp/.metadata``). torch's ``CheckpointException`` derives from ``BaseException`` and would
    escape every ``except Exception``: it becomes a :class:`CheckpointError` naming the folder."""
    from torch.distributed.checkpoint.api import CheckpointException

    require_known(folder)
    try:
        return fn(*args, **kwargs)
    except CheckpointException as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{folder / 'dcp'} cannot be read: {first}") from None


def _state_dicts(trainer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(trainer.model, trainer.optimizer)


def _buffers_from(msd: dict, module: torch.nn.Module, source: int) -> dict:
    """``msd`` with every buffer replaced by ``source``'s copy (a broadcast into clones: the live buffers are
    untouched). Every rank calls it, in the same key order."""
    import torch.distributed as dist

    names = sorted({name for name, _ in module.named_buffers()} & set(msd))
    out = dict(msd)
    for name in names:
        copy = msd[name].detach().clone()
        dist.broadcast(copy, src=source)
        out[name] = copy
    return out


def _begin(folder: Path, trainer, env, buffers_from: int | None) -> tuple[Path, dict]:
    """The temp folder (made by rank 0, seen by all) and the DCP state of this rank; every rank calls it."""
    from .. import distributed

    tmp = folder.parent / f".{folder.name}.tmp-dist"
    if env.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        private_mkdir(tmp)  # only this user enters it until the manifest vouches for what DCP wrote there
        (tmp / "dcp").mkdir()
    distributed.barrier(env)
    msd, osd = _state_dicts(trainer)
    if buffers_from is not None:
        msd = _buffers_from(msd, trainer.plain_model, buffers_from)
    return tmp, {"model": msd, "optimizer": osd}


@functools.cache
def hashing_file_system() -> type:
    """DCP's file system, every file it writes hashed on its way to the disk (:class:`~.writer.HashingWriter`): the
    manifest vouches for the bytes DCP wrote, never for a re-read in which a swapped shard (whose non-tensor items
    DCP unpickles) would be hashed as if it were ours. An instance's ``entries``: file -> manifest entry, by path.
    (A class made on first use: importing DCP's file system costs 0.8 s that a command which saves nothing should
    not pay.)"""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.entries: dict[str, dict] = {}
            self._lock = threading.Lock()

        @contextmanager
        def create_stream(self, path, mode):
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            w = HashingWriter(Path(path), CHECKPOINT_DIGEST)
            try:
                yield w
            finally:
                if not w.fh.closed:
                    w.fh.close()
            with self._lock:
                self.entries[str(path)] = w.entry()

        def rename(self, path, new_path) -> None:
            super().rename(path, new_path)
            with self._lock:  # DCP writes .metadata.tmp, then renames it
                self.entries[str(new_path)] = self.entries.pop(str(path))

    return HashingFileSystem


def _writer(tmp: Path):
    """DCP's writer into ``tmp/dcp``, through :func:`hashing_file_system` (``writer.fs.entries`` once written)."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(tmp / "dcp"))
    writer.fs = hashing_file_system()()
    return writer


def _dcp_entries(tmp: Path, writer) -> dict:
    return {str(Path(path).relative_to(tmp)): info for path, info in writer.fs.entries.items()}


def _hashed(tmp: Path, name: str, write, entries: dict) -> None:
    w = HashingWriter(tmp / name, CHECKPOINT_DIGEST)
    try:
        write(w)
    except BaseException:
        w.fh.close()
        raise
    w.close()
    entries[name] = w.entry()


def _write_small(tmp: Path, trainer, config: dict, env) -> dict:
    """This rank's RNG streams and data position, and (rank 0) the shared state files: kilobytes, written now, each
    hashed as it is written; returns their manifest entries."""
    def text(obj, **kw):
        return lambda fh: fh.write(json.dumps(obj, **kw).encode())

    entries: dict = {}
    rng_json, rng_tensors = capture_rng()
    _hashed(tmp, f"rng-rank{env.rank}.pt", lambda fh: torch.save(rng_tensors, fh), entries)
    _hashed(tmp, f"rng-rank{env.rank}.json", text(rng_json), entries)
    _hashed(tmp, f"trainer_state-rank{env.rank}.json", text(trainer.state(), sort_keys=True), entries)
    if env.is_main:
        _hashed(tmp, "scheduler.json", text(trainer.scheduler.state_dict(), sort_keys=True), entries)
        if trainer.scaler is not None:
            _hashed(tmp, "scaler.json", text(trainer.scaler.state_dict(), sort_keys=True), entries)
        _hashed(tmp, "config.json", text(config, sort_keys=True), entries)
    return entries


def _finish(tmp: Path, folder: Path, env, step: int, config_hash: str | None, written: dict, group=None) -> dict:
    """Once every rank's files are written: rank 0 gathers every rank's entries (each hashed as it was written) into
    the manifest and renames the folder into place; every rank gets the record. ``written``: this rank's entries, by
    path relative to ``tmp``; ``group``: the process group to agree over (None: the job's own)."""
    import torch.distributed as dist

    def barrier() -> None:
        if env.active:
            dist.barrier(group=group)

    barrier()
    every: list = [written]
    if env.active:
        every = [None] * env.world_size
        dist.all_gather_object(every, written, group=group)
    record: dict = {}
    if env.is_main:
        files = {name: info for part in every for name, info in sorted((part or {}).items())}
        manifest = {"format": "pilotrun-checkpoint/1", "layout": "dcp", "world_size": env.world_size,
                    "strategy": env.strategy, "step": step, "config_hash": config_hash, "files": files}
        raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
        with open(tmp / MANIFEST, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        publish_mode(tmp)
        fsync_dir(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
        fsync_dir(folder.parent)
        # The digest of the bytes written here, never of a re-read: what the ledger will call "known".
        record = {"files": files, "bytes": sum(f["bytes"] for f in files.values()), "manifest_sha256": sha256_hex(raw)}
    barrier()
    if not env.active:
        return record
    box = [record]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def save_distributed(folder: Path, trainer, config: dict, env, config_hash: str | None = None,
                     buffers_from: int | None = None) -> dict:
    """Every rank calls this; returns ``{"files": {...}, "bytes": n, "manifest_sha256": hex}`` on every rank.

    ``buffers_from``: the rank whose buffers are the training state (DDP: rank 0, which it broadcasts at
    each forward). DCP writes one copy of a tensor all ranks hold, from whichever rank balances the write
    load, so without this a buffer whose copies differ is saved from an arbitrary rank."""
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    tmp, state = _begin(folder, trainer, env, buffers_from)
    writer = _writer(tmp)
    dcp.save(state, storage_writer=writer)
    written = _write_small(tmp, trainer, config, env) | _dcp_entries(tmp, writer)
    return _finish(tmp, folder, env, trainer.step, config_hash, written)


def start_distributed(folder: Path, trainer, config: dict, env, config_hash: str | None = None,
                      buffers_from: int | None = None) -> PendingSave:
    """:func:`save_distributed` behind the job, through DCP's ``async_save``: every rank's state is copied to host
    memory (pinned where the runtime pins) before this returns; DCP's thread writes the shards, then a second
    thread of ours waits for them and agrees with the other ranks over a gloo group of its own (the job's
    communicator stays the job's: NCCL collectives from two threads would interleave) before rank 0 writes the
    manifest and renames the folder. Every rank calls it; :meth:`PendingSave.wait` on every rank too."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    t0 = time.perf_counter()
    folder = Path(folder)
    tmp, state = _begin(folder, trainer, env, buffers_from)
    pinned = query_devices().runtime.pin_memory
    # Staged now, in this thread (use_async_staging=False): once async_save returns the state is DCP's copy.
    stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=pinned))
    group = dist.new_group(backend="gloo") if env.active else None
    writer = _writer(tmp)
    upload = dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=stager)
    if not isinstance(upload, Future):  # torch answers an AsyncSaveResponse only to staging that runs behind
        raise TypeError(f"torch.distributed.checkpoint.async_save returned {type(upload).__name__} to staging done "
                        "before it returns: this torch's async_save is not the one pilotrun was written against")
    small = _write_small(tmp, trainer, config, env)
    step = trainer.step
    blocking = time.perf_counter() - t0

    def finish() -> tuple[dict, float]:
        try:
            upload.result()
        finally:
            stager.close()
        try:
            written = small | _dcp_entries(tmp, writer)
            return _finish(tmp, folder, env, step, config_hash, written, group), time.perf_counter()
        finally:
            if group is not None:
                dist.destroy_process_group(group)

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pilotrun-background-dcp")
    future = pool.submit(finish)
    pool.shutdown(wait=False)
    return PendingSave(folder, blocking, future, t0)


def tied_names(model: torch.nn.Module) -> list[list[str]]:
    """Groups of state-dict names that are one tensor in ``model`` (tied embeddings: ``lm_head.weight`` and
    ``model.embed_tokens.weight``), in the names ``get_model_state_dict`` uses (no DDP ``module.`` prefix)."""
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    owners: dict[int, list[str]] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)]:
        owners.setdefault(id(tensor), []).append(name)
    return [names for names in owners.values() if len(names) > 1]


def retie(state: dict, groups: list[list[str]]) -> dict:
    """``state`` with each group's entries made one tensor again, the first name's."""
    out = dict(state)
    for names in groups:
        present = [n for n in names if n in out]
        for name in present[1:]:
            out[name] = out[present[0]]
    return out


def full_model_state_dict(model) -> dict:
    """The complete weights gathered from every rank (each rank calls this; they land on CPU).

    Gathering makes one CPU tensor per name, so tied weights arrive as separate copies; they are
    made one tensor again, so the export stores them once as ``save_pretrained`` and
    ``safetensors.torch.save_model`` do in one process (both drop names that share storage)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return retie(state, tied_names(model))


def restore_distributed(trainer, folder: Path, env) -> dict:
    """Load a DCP checkpoint into a freshly built (and wrapped) trainer on every rank, from a pinned view of it (the
    files checked are the files DCP reads and unpickles)."""
    with pinned(folder) as view:
        return _restore_from(trainer, view.folder, env)


def _restore_from(trainer, folder: Path, env) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    manifest = read_manifest(folder)
    if manifest.get("world_size") != env.world_size:
        raise CheckpointError(f"{folder} was written by {manifest.get('world_size')} processes, this job has "
                              f"{env.world_size}: convert it (pilotrun convert) and load the single file instead")
    check_config(folder, job_hash(trainer))
    msd, osd = _state_dicts(trainer)
    state = {"model": msd, "optimizer": osd}
    _dcp_call(folder, dcp.load, state, checkpoint_id=str(folder / "dcp"))
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    trainer.scheduler.load_state_dict(load_state_json(folder / "scheduler.json", trainer.scheduler.state_dict()))
    if trainer.scaler is not None:
        trainer.scaler.load_state_dict(load_state_json(folder / "scaler.json", trainer.scaler.state_dict()))
    rng_json, _ = capture_rng()
    restore_rng(load_state_json(folder / f"rng-rank{env.rank}.json", rng_json),
                load_torch_file(folder / f"rng-rank{env.rank}.pt"))
    st = load_state_json(folder / f"trainer_state-rank{env.rank}.json", trainer.state())
    check_trainer_state(folder / f"trainer_state-rank{env.rank}.json", st, manifest)
    trainer.load_state(st)
    return st


def convert(folder: Path, out: Path, policy: LoadPolicy) -> dict:
    """A DCP checkpoint as one file that needs none of the original processes: ``.pt`` or ``.safetensors``
    (model weights only for safetensors; everything for ``.pt``). Only a folder the ledger knows is read: DCP
    metadata is a pickle."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder, out = Path(folder), Path(out)
    if read_manifest(folder).get("layout") != "dcp":
        raise CheckpointError(f"{folder} is a single-process checkpoint already (model-*.pt shards load directly)")
    policy.admit(folder)
    tmp_pt = out.with_suffix(".pt.tmp")
    try:
        with pinned(folder) as view:
            _dcp_call(view.folder, dcp_to_torch_save, str(view.folder / "dcp"), str(tmp_pt))
        state = torch.load(tmp_pt, map_location="cpu", weights_only=True)
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            weights = {k: v.contiguous() for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
            save_file(weights, str(out))
            return {"path": str(out), "tensors": len(weights)}
        os.replace(tmp_pt, out)
        return {"path": str(out), "keys": sorted(state)}
    finally:
        tmp_pt.unlink(missing_ok=True)


def is_distributed_checkpoint(folder: Path) -> bool:
    try:
        return read_manifest(folder).get("layout") == "dcp"
    except CheckpointError:
        return False

