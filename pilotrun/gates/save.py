"""``save``: the full training state written atomically with a manifest of file digests; time and bytes.

The strategy chooses the layout (one process: sharded ``.pt`` files; several: DCP) and whether the write runs behind
the job (on an accelerator: the state is copied to pinned host memory and written by a background thread in one
process, by DCP's ``async_save`` in several). The row keeps apart what the job waited (``blocking_seconds``: the
plan charges that per checkpoint) and the whole save until the checkpoint is complete (``write_seconds``). The gate
also records fingerprints of the live state, which ``restore`` must reproduce.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from .. import distributed
from ..checkpoint.io import disk_full_error, remove_stale_temps
from ..checkpoint.saving import release_staging
from ..checkpoint.trust import admitted, manifest_sha256
from ..drivers import Capability
from ..humanize import human_bytes, human_seconds
from ..ledger.details import SaveDetails
from ..ledger.records import Failure, GateName
from ..safefile import free_bytes
from .base import Gate, GateFailure, OnProgram, Outcome, Product
from .context import SavedCheckpoint


def expect_path(folder: Path, rank: int | str | None = None) -> Path:
    """Where the fingerprints of ``folder`` live: one file for one process, one per rank for several
    (``rank="{rank}"`` gives the pattern the restore worker fills in)."""
    suffix = "" if rank is None else f".rank{rank}"
    return folder.parent / f"{folder.name}.expect{suffix}.json"


class SaveGate(Gate):
    name = GateName.SAVE
    on_program = OnProgram.STAGE
    program_note = "wrap the checkpoint write in `with job.stage(\"save\"):`"
    needs = (Product.FIRST_UPDATE,)
    produces = (Product.CHECKPOINT,)
    requires = (Capability.FULL_STATE,)
    job_memory = True
    carry = True

    def recover(self, ctx, row) -> bool:
        """The interrupted run's checkpoint (the one the driver was restored from) and its fingerprints."""
        folder = ctx.restore_from
        if folder is None or not expect_path(folder).exists():
            return False  # without the fingerprints the restore gate needs a fresh save
        # --resume admitted it (pilot.resume.plan_resume, in this process): the digest of the manifest bytes it
        # checked, which the restore's pinned view must find again. A caller that admitted nothing gets the folder's
        # digest as it is now; the restore worker then admits the folder against it.
        adm = admitted(folder)
        saved = SaveDetails.of(row.details)
        manifest = adm.manifest_sha256 if adm is not None else manifest_sha256(folder)
        # The parent's save row vouches for the expect file of the checkpoint it wrote only (its manifest's digest;
        # a later checkpoint may be the one resumed, and the row's path may be relative to another folder).
        recorded = saved.expect_sha256 if saved.manifest_sha256 == manifest else None
        ctx.checkpoint = SavedCheckpoint(folder, expect_path(folder), manifest, tuple(recorded or ()))
        return True

    def run(self, ctx, meter) -> Outcome:
        driver = ctx.driver
        assert driver is not None
        env = ctx.env
        folder = ctx.out_dir / "checkpoints" / f"step-{driver.step:06d}"
        # What a restore must reproduce, from the live objects (state outside state_dict included).
        expect = driver.fingerprint()
        stale = self._remove_stale(ctx, folder.parent) if env.is_main else []
        t0 = time.perf_counter()
        try:
            pending = driver.start_save(folder)
            # The checkpoint counts once its manifest is durable and the folder in place, however it was written.
            written = pending.wait()
        except Exception as exc:
            raise write_failure(folder, exc, ctx.base_inputs()) from exc
        finally:
            # The pilot saves once: its host copy is not kept for a next save (whose copy would then skip the
            # allocation: the row's blocking time is the first save's, an upper bound of a long run's).
            release_staging()
        seconds = time.perf_counter() - t0
        blocking = min(pending.blocking_seconds, seconds)
        files, total = written["files"], written["bytes"]
        # Each rank's fingerprints: its own shards, RNG streams and data position.
        mine = expect_path(folder, env.rank if env.active else None)
        text = json.dumps(expect, sort_keys=True)
        mine.write_text(text)
        # Every rank's digest, so the restore (started by rank 0 for all ranks) reads only the bytes written here.
        digests = tuple(distributed.gather(env, hashlib.sha256(text.encode()).hexdigest()))
        # The digest of the manifest bytes the save wrote, never a re-read of the folder: a manifest swapped in after
        # the rename is not the one that becomes "known".
        ctx.checkpoint = SavedCheckpoint(folder, expect_path(folder, "{rank}" if env.active else None),
                                         written["manifest_sha256"], digests)
        if env.is_main:
            (ctx.out_dir / "checkpoints" / "LATEST").write_text(folder.name + "\n")
        out = Outcome(inputs=ctx.base_inputs())
        out.details = SaveDetails(
            path=str(folder), bytes=total, files=files, step=driver.step, layout=ctx.strategy.checkpoint_layout,
            bytes_per_second=total / seconds if seconds else None, write_seconds=seconds,
            manifest_sha256=ctx.checkpoint.manifest_sha256, expect=str(mine), expect_sha256=list(digests),
            stale_temps_removed=[{"path": str(p), "bytes": n} for p, n in stale] if stale else None,
            blocking_seconds=blocking, blocking_bytes_per_second=total / blocking if blocking else None).to_dict()
        out.reason = (f"step {driver.step}: {human_bytes(total)} in {len(files)} files in "
                      f"{human_seconds(seconds)} ({human_bytes(total / seconds if seconds else 0)}/s), "
                      "written atomically with a manifest of file digests")
        if pending.behind:
            out.reason += (f"; the job waited {human_seconds(blocking)} (the copy to host memory), the rest was "
                           "written behind it")
        if stale:
            freed = sum(n for _, n in stale)
            out.reason += (f"; removed {len(stale)} temp folder(s) of saves whose process is gone, freeing "
                           f"{human_bytes(freed)}")
        return out

    @staticmethod
    def _remove_stale(ctx, root: Path) -> list[tuple[Path, int]]:
        """Temp folders of killed saves in this run's checkpoints and, on --resume, in the parent's."""
        roots = [root]
        if ctx.restore_from is not None and Path(ctx.restore_from).parent.resolve() != root.resolve():
            roots.append(Path(ctx.restore_from).parent)
        return [r for folder in roots for r in remove_stale_temps(folder)]


def write_failure(folder: Path, exc: Exception, inputs: dict) -> GateFailure:
    """A failed save as a row: the folder, what the filesystem said, and the free space measured after it."""
    free = free_bytes(folder)
    free_text = (f"{human_bytes(free)} free on its filesystem now" if free is not None
                 else "free space not measured: the filesystem did not answer")
    details = {"path": str(folder), "free_bytes": free, "error": f"{type(exc).__name__}: {exc}"}
    full = disk_full_error(exc)
    if full is not None:
        where = full.filename or folder
        details["errno"] = full.errno
        return GateFailure(f"save to {folder}: No space left on device while writing {where} ({free_text}); free "
                           "space there or pass --out on a larger disk",
                           inputs=inputs, details=details, failure=Failure.ERROR)
    message = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return GateFailure(f"save to {folder}: {type(exc).__name__}: {message} ({free_text})", inputs=inputs,
                       details=details, failure=Failure.ERROR)
