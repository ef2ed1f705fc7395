"""``export``: the inference artifact (safetensors + config, export.json for factory models, an adapter + base.json;
or the framework's own save), written atomically with a sha256 manifest whose hash the row records.

Written once for every view (:mod:`pilotrun.gates.view`): the view writes its artifact (pilotrun's export, a
Trainer's ``save_model``, Lightning's ``save_checkpoint``); the check refuses one without weights in the format its
reload reads, or without tensors, and says what was written.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..checkpoint.io import CheckpointError
from ..checkpoint.trust import LoadPolicy
from ..drivers import Capability
from ..humanize import human_bytes
from ..ledger.details import ExportDetails
from ..ledger.records import GateName
from .base import NEEDS_INTEGRATION, Gate, GateFailure, OnProgram, Outcome, ProbeSite, Product, on_main_rank
from .view import Exported, TrainingView


def _adapter_reason(out: Outcome, written: Exported) -> None:
    a = written.adapter or {}
    out.reason = (f"PEFT adapter ({written.tensors} tensors, {human_bytes(a.get('adapter_bytes', 0))}) + "
                  f"adapter_config.json + base.json (the base's reference and identity, not its weights) to "
                  f"{written.folder.name}/ with a sha256 manifest; the adapter {written.state}")
    if a.get("merged"):
        out.reason += f"; merged model in {a['merged_folder']}/ ({human_bytes(a.get('merged_bytes', 0))})"
    elif a.get("merge_requested"):
        out.warn(f"{out.reason}; export.merge: merged model {a.get('merge_note')}")


def check_export(view: TrainingView, folder: Path, out: Outcome | None = None) -> Outcome:
    """Write the view's artifact to ``folder`` and judge it; GateFailure when it cannot be reloaded."""
    out = out or Outcome()
    written = view.export(folder)
    who = written.written_by or "the export"
    if not written.weights:
        raise GateFailure(f"{who} wrote no {written.weights_format} weights in {folder} "
                          f"({', '.join(sorted(written.files))}): pilotrun reloads {written.weights_format} only",
                          inputs=out.inputs, details={"files": sorted(written.files), "path": str(folder)})
    if written.tensors == 0:
        raise GateFailure(f"the export in {folder} holds no tensors", inputs=out.inputs)
    details = ExportDetails(path=str(folder), files=written.files, bytes=written.total_bytes, tensors=written.tensors,
                            manifest_sha256=written.manifest_sha256, written_by=written.written_by)
    out.details = {**details.to_dict(), **written.details}
    if written.adapter is not None:
        a = written.adapter
        out.details = {**replace(details, adapter=True, base_identity=a.get("base_identity"), merged=a.get("merged"),
                                 merge_note=a.get("merge_note")).to_dict(), **written.details}
        _adapter_reason(out, written)
        return out
    counted = f"{written.tensors} tensors in " if written.tensors is not None else ""
    out.reason = (f"{counted}{len(written.weights)} {written.weights_format} file(s), "
                  f"{human_bytes(written.total_bytes)} in all, to {folder.name}/ with a sha256 manifest"
                  + (f", written by {written.written_by}" if written.written_by else "")
                  + (f"; the model {written.state}" if written.state else "")
                  + (f"; {written.note}" if written.note else ""))
    return out


def probe(view: TrainingView, site: ProbeSite) -> Outcome:
    """The gate on a framework's view, in the program's process (``Gate.probe``)."""
    return check_export(view, site.export_folder)


class ExportGate(Gate):
    name = GateName.EXPORT
    on_program = OnProgram.INTEGRATION
    probe = staticmethod(probe)
    program_note = NEEDS_INTEGRATION
    needs = (Product.DRIVER,)
    produces = (Product.EXPORT,)
    requires = (Capability.EXPORT,)
    job_memory = True
    carry = True

    def recover(self, ctx, row) -> bool:
        """The interrupted run's export, only when it is still exactly what its row recorded (every file against
        the manifest, the manifest's sha256 against the row); otherwise the export is written again."""
        path, sha = row.details.get("path"), row.details.get("manifest_sha256")
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
        view = ctx.view(export_weights=ctx.driver.export_weights())
        folder = ctx.out_dir / "export"
        inputs = {"precision": ctx.spec.train.precision, "rank": ctx.rank, "world_size": ctx.world_size}
        out = on_main_rank(ctx, self, lambda: self._export(ctx, view, folder, inputs))
        ctx.export_dir = folder  # on every rank: what reload_eval reads (rank 0 wrote it)
        return out

    def _export(self, ctx, view, folder: Path, inputs: dict) -> Outcome:
        out = check_export(view, folder, Outcome(inputs=inputs))
        # Recorded in the row: what makes the export known to reload_eval, --resume and archive.
        ctx.export_manifest_sha256 = out.details["manifest_sha256"]
        return out
