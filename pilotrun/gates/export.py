"""``export``: the inference artifact (safetensors + config, or + export.json for factory models)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..checkpoint.export import BASE_JSON, MERGED, safetensors_tensor_count
from ..checkpoint.io import CheckpointError
from ..checkpoint.trust import LoadPolicy, manifest_sha256
from ..drivers import Capability
from ..humanize import human_bytes
from ..ledger.details import ExportDetails
from ..ledger.records import GateName
from .base import Gate, GateFailure, Outcome, Product, on_main_rank


class ExportGate(Gate):
    name = GateName.EXPORT
    needs = (Product.DRIVER,)
    produces = (Product.EXPORT,)
    requires = (Capability.EXPORT,)
    job_memory = True
    carry = True

    def recover(self, ctx, row) -> bool:
        """The interrupted run's export, only when it is still exactly what its row recorded (every file against
        the manifest, the manifest's sha256 against the row); otherwise the export is written again."""
        details = row.get("details") or {}
        path, sha = details.get("path"), details.get("manifest_sha256")
        if not path or not sha or not Path(path).exists():
            return False
        try:
            adm = LoadPolicy.of({sha}).admit(Path(path))
        except CheckpointError:
            return False
        ctx.export_dir, ctx.export_manifest_sha256 = adm.folder, adm.manifest_sha256
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
        # Recorded in the row: what makes the export known to reload_eval, --resume and archive.
        ctx.export_manifest_sha256 = written.manifest_sha256 or manifest_sha256(folder)
        n_tensors = safetensors_tensor_count(folder)
        if n_tensors == 0:
            raise GateFailure(f"the export in {folder} holds no tensors")
        weights = {k: v for k, v in written.files.items() if k.endswith(".safetensors")}
        out = Outcome(inputs={"precision": spec.train.precision, "rank": ctx.rank, "world_size": ctx.world_size})
        details = ExportDetails(path=str(folder), files=written.files, bytes=written.total_bytes, tensors=n_tensors,
                                manifest_sha256=ctx.export_manifest_sha256)
        out.details = details.to_dict()
        trained = ctx.driver.step
        state = f"after {trained} update(s)" if trained else "as loaded (no update succeeded)"
        if spec.model.adapter is not None:
            base = json.loads((folder / BASE_JSON).read_text())
            out.details = replace(details, adapter=True, base_identity=base.get("base_identity"),
                                  merged=base.get("merged"), merge_note=base.get("merge_note")).to_dict()
            adapter_bytes = written.files["adapter_model.safetensors"]["bytes"]
            out.reason = (f"PEFT adapter ({n_tensors} tensors, {human_bytes(adapter_bytes)}) + adapter_config.json + "
                          f"base.json (the base's reference and identity, not its weights) to {folder.name}/ with a "
                          f"sha256 manifest; the adapter {state}")
            if base.get("merged"):
                merged_bytes = sum(v["bytes"] for k, v in written.files.items() if k.startswith(f"{MERGED}/"))
                out.reason += f"; merged model in {MERGED}/ ({human_bytes(merged_bytes)})"
            elif spec.export.merge:
                out.warn(f"{out.reason}; export.merge: merged model {base.get('merge_note')}")
            return out
        out.reason = (f"{n_tensors} tensors in {len(weights)} safetensors file(s), {human_bytes(written.total_bytes)} "
                      f"in all, to {folder.name}/ with a sha256 manifest; the model {state}")
        return out
