"""``save``: the full training state written atomically with a sha256 manifest; time and bytes."""
from __future__ import annotations

import json
import time

from ..checkpoint.dist import save_distributed
from ..checkpoint.state import fingerprint_state, manifest_sha256, save_checkpoint
from ..ui.format import human_bytes, human_seconds
from .base import Gate, Outcome


class SaveGate(Gate):
    name = "save"
    depends_on = ("first_step",)

    def run(self, ctx, meter) -> Outcome:
        trainer = ctx.trainer
        folder = ctx.out_dir / "checkpoints" / f"step-{trainer.step:06d}"
        # What a restore must reproduce, from the live objects (state outside state_dict included).
        expect = fingerprint_state(trainer)
        env = trainer.env
        t0 = time.perf_counter()
        if env.active:
            written = save_distributed(folder, trainer, ctx.spec.canonical(), env, ctx.spec.config_hash())
            files, total = written["files"], written["bytes"]
        else:
            record = save_checkpoint(folder, trainer, ctx.spec.canonical(), ctx.spec.config_hash())
            files, total = record.files, record.total_bytes
        seconds = time.perf_counter() - t0
        ctx.checkpoint_dir = folder
        # Each rank's fingerprints: its own shards, RNG streams and data position.
        suffix = f".rank{env.rank}" if env.active else ""
        expect_path = folder.parent / f"{folder.name}.expect{suffix}.json"
        expect_path.write_text(json.dumps(expect, sort_keys=True))
        ctx.checkpoint_expect = folder.parent / f"{folder.name}.expect{'.rank{rank}' if env.active else ''}.json"
        ctx.checkpoint_manifest = manifest_sha256(folder)
        if env.is_main:
            (ctx.out_dir / "checkpoints" / "LATEST").write_text(folder.name + "\n")
        out = Outcome(inputs=ctx.base_inputs())
        out.details = {"path": str(folder), "bytes": total, "files": files, "step": trainer.step,
                       "layout": "torch.distributed.checkpoint (DCP)" if env.active else "single process",
                       "bytes_per_second": total / seconds if seconds else None, "write_seconds": seconds,
                       "manifest_sha256": ctx.checkpoint_manifest, "expect": str(expect_path)}
        out.reason = (f"step {trainer.step}: {human_bytes(total)} in {len(files)} files in "
                      f"{human_seconds(seconds)} ({human_bytes(total / seconds if seconds else 0)}/s), "
                      "written atomically with a sha256 manifest")
        return out
