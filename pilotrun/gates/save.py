"""``save``: the full training state written atomically with a sha256 manifest; time and bytes."""
from __future__ import annotations

import json
import time

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
        t0 = time.perf_counter()
        written = save_checkpoint(folder, trainer, ctx.spec.canonical(), ctx.spec.config_hash())
        seconds = time.perf_counter() - t0
        ctx.checkpoint_dir = folder
        expect_path = folder.parent / f"{folder.name}.expect.json"
        expect_path.write_text(json.dumps(expect, sort_keys=True))
        ctx.checkpoint_expect = expect_path
        ctx.checkpoint_manifest = manifest_sha256(folder)
        (ctx.out_dir / "checkpoints" / "LATEST").write_text(folder.name + "\n")
        total = written.total_bytes
        out = Outcome(inputs=ctx.base_inputs())
        out.details = {"path": str(folder), "bytes": total, "files": written.files, "step": trainer.step,
                       "bytes_per_second": total / seconds if seconds else None, "write_seconds": seconds,
                       "manifest_sha256": ctx.checkpoint_manifest, "expect": str(expect_path)}
        out.reason = (f"step {trainer.step}: {human_bytes(total)} in {len(written.files)} files in "
                      f"{human_seconds(seconds)} ({human_bytes(total / seconds if seconds else 0)}/s), "
                      "written atomically with a sha256 manifest")
        return out
