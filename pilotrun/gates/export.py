"""``export``: the inference artifact (safetensors + config, or + export.json for factory models)."""
from __future__ import annotations

from pathlib import Path

from ..checkpoint.export import safetensors_tensor_count
from ..drivers import Capability
from ..humanize import human_bytes
from .base import Gate, GateFailure, Outcome, Product, on_main_rank


class ExportGate(Gate):
    name = "export"
    needs = (Product.DRIVER,)
    produces = (Product.EXPORT,)
    requires = (Capability.EXPORT,)
    job_memory = True
    carry = True

    def recover(self, ctx, row) -> bool:
        path = (row.get("details") or {}).get("path")
        if not path or not Path(path).exists():
            return False
        ctx.export_dir = Path(path)
        return True

    def run(self, ctx, meter) -> Outcome:
        # Every rank takes part in gathering the full weights; rank 0 alone receives and writes them.
        weights = ctx.driver.export_weights()
        out = on_main_rank(ctx, self, lambda: self._export(ctx, weights))
        ctx.export_dir = ctx.out_dir / "export"  # on every rank: what reload_eval reads (rank 0 wrote it)
        return out

    def _export(self, ctx, weights) -> Outcome:
        spec = ctx.spec
        folder = ctx.out_dir / "export"
        written = ctx.driver.write_export(folder, weights)
        ctx.export_dir = folder
        n_tensors = safetensors_tensor_count(folder)
        if n_tensors == 0:
            raise GateFailure(f"the export in {folder} holds no tensors")
        weights = {k: v for k, v in written.files.items() if k.endswith(".safetensors")}
        out = Outcome(inputs={"precision": spec.train.precision, "rank": ctx.rank, "world_size": ctx.world_size})
        out.details = {"path": str(folder), "files": written.files, "bytes": written.total_bytes, "tensors": n_tensors}
        trained = ctx.driver.step
        state = f"after {trained} update(s)" if trained else "as loaded (no update succeeded)"
        out.reason = (f"{n_tensors} tensors in {len(weights)} safetensors file(s), {human_bytes(written.total_bytes)} "
                      f"in all, to {folder.name}/ with a sha256 manifest; the model {state}")
        return out
