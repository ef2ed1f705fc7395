"""``reload_eval``: the exported artifact, reloaded in a separate process, reproduces the model's outputs.

Written once for every view (:mod:`pilotrun.gates.view`). Control inputs are the first validation examples. The
model as the job holds it runs them twice in eval mode without reseeding — different outputs mean it is not
deterministic in eval mode (dropout applied regardless of ``model.eval()``). A fresh process then loads only the
artifact, admitted by pilotrun's loading policy against the manifest its export row recorded, and runs the same
inputs (pilotrun's rebuild; a Trainer's ``from_pretrained``; Lightning's ``load_from_checkpoint``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..drivers import Capability
from ..ledger.records import GateName, Verdict
from .base import NEEDS_INTEGRATION, Gate, GateFailure, OnProgram, Outcome, ProbeSite, Product, on_main_rank
from .view import Artifact, NotMeasured, TrainingView

RTOL, ATOL = 1e-4, 1e-5
# A merged export computes (W + s·BA) x instead of W x + s·B(A x): the same sum in another order, whose fp32
# rounding is a few ulps of the outputs' scale per layer, not of each output (an output near 0 gets an error
# of the size of its neighbours'). So the merged model is compared on the outputs' scale: the largest difference
# at most this fraction of the largest output (at least 1). In bf16 each merged weight is itself rounded to 8
# bits of mantissa (2^-8 ≈ 0.4%): under both precisions that hold the base in bf16.
MERGED_SCALE_TOL = {"bf16-true": 2e-2, "bf16-true-autocast": 2e-2}
MERGED_SCALE_TOL_DEFAULT = 1e-4
# The model as training runs it computes with 2-byte copies of its fp32 parameters (FSDP2's MixedPrecisionPolicy),
# and so does the reload of the export: the same rounded weights. On the CPU the same kernels give the same outputs
# (the usual tolerance holds). From a GPU, the job's kernels and the reload's CPU ones round each output again in
# bf16: compared on the outputs' scale at bf16's rounding, as a merged export is; a wrong or missing weight moves
# outputs by far more, and the stored dtypes are compared apart (Reloaded.master_dtypes).
GATHERED_SCALE_TOL = 2e-2


def reference(view: TrainingView) -> tuple[list, object, torch.Tensor, torch.Tensor]:
    """(control items, their batch, the job's outputs on them twice): every rank of a sharded model takes part."""
    items = view.control_items()
    batch = view.data.collate(items)
    return items, batch, view.outputs(batch), view.outputs(batch)


def compare_reload(view: TrainingView, artifact: Artifact, items: list, batch, first: torch.Tensor,
                   second: torch.Tensor, work: Path, out: Outcome | None = None,
                   merged_tol: float = MERGED_SCALE_TOL_DEFAULT) -> Outcome:
    """The fresh process's outputs against the job's; GateFailure when they differ (or eval mode is random)."""
    out = out or Outcome()
    n = len(items)
    out.details = {"control_ids": [str(it["id"]) if isinstance(it, dict) and "id" in it else f"#{i}"
                                   for i, it in enumerate(items)],
                   "output_shape": list(first.shape), "tolerance": {"rtol": RTOL, "atol": ATOL}}
    problem = view.reload_problem(artifact)
    if problem is not None:
        raise NotMeasured(problem)
    if not torch.equal(first, second):
        diff = float((first - second).abs().max())
        raise GateFailure(f"the model is not deterministic in eval mode: the same {n} inputs twice, without "
                          f"reseeding, differ by up to {diff:.3g} — dropout applied regardless of model.eval() "
                          "(F.dropout without training=self.training?) or another unseeded random op",
                          inputs=out.inputs, details=out.details)
    if artifact.manifest_sha256 is None:
        raise GateFailure(f"the export in {artifact.folder} has no manifest sha256 recorded by its export row: "
                          "it is not loaded (run the export gate again)", inputs=out.inputs, details=out.details)
    reloaded = view.reload(artifact, batch, work)
    out.details["reloaded_class"] = reloaded.model_class
    if reloaded.master_dtypes is not None and set(reloaded.stored_float_dtypes) - set(reloaded.master_dtypes):
        raise GateFailure(f"the export in {artifact.folder.name}/ stores its parameters in "
                          f"{', '.join(reloaded.stored_float_dtypes)} where training keeps them in "
                          f"{', '.join(reloaded.master_dtypes)}: it holds the copies the model computes with, not "
                          "the weights trained", inputs=out.inputs, details=out.details)
    merged_line = ""
    if reloaded.merged_outputs is not None:
        merged_line = _compare_merged(artifact, reloaded.merged_outputs, first, out, merged_tol)
    if reloaded.outputs.shape != first.shape:
        raise GateFailure(f"the reloaded artifact returns outputs of shape {tuple(reloaded.outputs.shape)}, the "
                          f"model {tuple(first.shape)}", inputs=out.inputs, details=out.details)
    diff = float((reloaded.outputs - first).abs().max()) if first.numel() else 0.0
    out.details["max_abs_difference"] = diff
    if view.reference_note:
        out.details["reference"] = view.reference_note
    if view.reference_dtype is not None and view.reference_device != "cpu":
        scale = max(1.0, float(first.abs().max())) if first.numel() else 1.0
        out.details["tolerance"] = {"output_scale_fraction": GATHERED_SCALE_TOL, "output_scale": scale}
        close, bound = diff <= GATHERED_SCALE_TOL * scale, f"{GATHERED_SCALE_TOL:g} x the output scale {scale:.3g}"
    else:
        close, bound = torch.allclose(reloaded.outputs, first, rtol=RTOL, atol=ATOL), f"rtol {RTOL:g}, atol {ATOL:g}"
    if not close:
        cause = _weights_cause(view, artifact, out)
        raise GateFailure(f"the reloaded artifact ({reloaded.model_class}) does not reproduce the model's "
                          f"outputs on {n} control inputs: max difference {diff:.3g} ({bound}) — "
                          f"{cause}", inputs=out.inputs, details=out.details)
    note = f" ({view.reference_note})" if view.reference_note else ""
    out.reason = (f"{reloaded.what} reloaded from {artifact.folder.name}/ in a fresh process reproduces the outputs "
                  f"on {n} control inputs (max difference {diff:.2g}){merged_line}; eval mode is deterministic{note}")
    return out


def _weights_cause(view: TrainingView, artifact: Artifact, out: Outcome) -> str:
    """What the outputs' difference is blamed on, having compared the export's tensors with the model's: "weights
    missing" only when some are, by name."""
    live = view.export_state()
    if live is None:
        return ("the export's tensors were not compared with the model's (this view cannot name them in the "
                "export's terms): weights missing from the export, or state the artifact does not carry")
    diff = weight_differences(live, artifact)
    out.details["weights"] = diff
    if not diff["missing"] and not diff["differ"]:
        return (f"yet all {diff['compared']} tensors of the export equal the model's: the difference is in what the "
                "weights do not carry (a buffer rebuilt differently, a config field, a forward the program patches)")
    parts = []
    if diff["missing"]:
        parts.append(f"{len(diff['missing'])} of the model's tensors are missing from the export "
                     f"({', '.join(diff['missing'][:5])})")
    if diff["differ"]:
        parts.append(f"{len(diff['differ'])} differ from the model's ({', '.join(diff['differ'][:5])})")
    if diff["extra"]:
        parts.append(f"the export holds {len(diff['extra'])} tensor(s) the model does not "
                     f"({', '.join(diff['extra'][:5])}; renamed?)")
    return "; ".join(parts)


def export_state_of(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's tensors named as an export stores them: a PEFT model's adapter alone (``adapter_model`` names),
    else its state dict; None for sharded tensors (the gathered ones are the export's own)."""
    from ..models.adapters import is_adapter_model

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    if is_adapter_model(model):
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model)
    else:
        state = model.state_dict()
    if any(hasattr(t, "full_tensor") for t in state.values()):
        return None
    return state


def weight_differences(live: dict[str, torch.Tensor], artifact: Artifact) -> dict:
    """The export's safetensors (its admitted manifest's files, merged/ aside) against ``live``: tensors missing
    from the export (a tied weight stored once is not missing), differing, and the export's extras."""
    from safetensors import safe_open

    from ..checkpoint.trust import LoadPolicy

    adm = LoadPolicy.of([artifact.manifest_sha256]).admit(artifact.folder)
    stored: dict[str, torch.Tensor] = {}
    for name in sorted(adm.manifest["files"]):
        if name.endswith(".safetensors") and not name.startswith("merged/"):
            with safe_open(str(artifact.folder / name), framework="pt") as fh:
                stored.update({k: fh.get_tensor(k) for k in fh.keys()})
    def storage(key: str, t: torch.Tensor) -> tuple:
        # An empty or meta tensor has no storage to share (data_ptr 0): never taken for another's tied copy.
        if t.numel() == 0 or t.device.type == "meta":
            return (key,)
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))

    by_storage: dict[tuple, list[str]] = {}
    for key, t in live.items():
        by_storage.setdefault(storage(key, t), []).append(key)
    missing, differ = [], []
    for key, t in live.items():
        if key in stored:
            if stored[key].shape != t.shape or not torch.equal(stored[key], t.detach().to("cpu", stored[key].dtype)):
                differ.append(key)
        elif not any(k in stored for k in by_storage[storage(key, t)]):
            missing.append(key)
    return {"compared": sum(k in stored for k in live), "missing": missing, "differ": differ,
            "extra": sorted(set(stored) - set(live))}


def _compare_merged(artifact: Artifact, merged: torch.Tensor, first: torch.Tensor, out: Outcome,
                    fraction: float) -> str:
    scale = max(1.0, float(first.abs().max())) if first.numel() else 1.0
    if merged.shape != first.shape:
        raise GateFailure(f"the merged model returns outputs of shape {tuple(merged.shape)}, the model "
                          f"{tuple(first.shape)}", inputs=out.inputs, details=out.details)
    diff = float((merged - first).abs().max()) if first.numel() else 0.0
    out.details["merged"] = {"max_abs_difference": diff, "output_scale": scale,
                             "tolerance": f"{fraction:g} x the output scale"}
    if not diff <= fraction * scale:
        raise GateFailure(f"the merged model in {artifact.folder.name}/merged/ does not reproduce the adapter "
                          f"model's outputs: max difference {diff:.3g}, more than {fraction:g} of the outputs' "
                          f"scale {scale:.3g}", inputs=out.inputs, details=out.details)
    return f"; the merged model in merged/ too (max difference {diff:.2g})"


def reload_after(view: TrainingView, export: Outcome, work: Path) -> Outcome:
    """reload_eval on the export a framework's probes just wrote; skip (naming why) when the export did not pass."""
    if export.verdict.blocks:
        return Outcome(Verdict.SKIP, f"skipped: export did not pass ({export.reason})")
    items, batch, first, second = reference(view)
    work.mkdir(parents=True, exist_ok=True)
    artifact = Artifact(Path(export.details["path"]), export.details["manifest_sha256"])
    return compare_reload(view, artifact, items, batch, first, second, work)


def probe(view: TrainingView, site: ProbeSite) -> Outcome:
    """The gate on a framework's view, in the program's process (``Gate.probe``)."""
    return reload_after(view, site.outcomes[GateName.EXPORT], site.export_folder.parent / "pilotrun-reload")


class ReloadEvalGate(Gate):
    name = GateName.RELOAD_EVAL
    on_program = OnProgram.INTEGRATION
    probe = staticmethod(probe)
    program_note = NEEDS_INTEGRATION
    needs = (Product.DRIVER, Product.EXPORT)
    requires = (Capability.MODEL, Capability.EXPORT)

    def track(self, ctx):
        return [ctx.model] if ctx.model is not None else []

    def run(self, ctx, meter) -> Outcome:
        view = ctx.view()
        items, batch, first, second = reference(view)  # the model as training runs it: every rank takes part
        inputs = {**ctx.base_inputs(), "control_examples": len(items), "batch_size": len(items)}
        artifact = Artifact(ctx.export_dir, ctx.export_manifest_sha256)
        tol = MERGED_SCALE_TOL.get(ctx.spec.train.precision, MERGED_SCALE_TOL_DEFAULT)
        if view.reference_dtype is not None:  # set by the reference forwards: the merged weights round in it too
            tol = max(tol, GATHERED_SCALE_TOL)
        return on_main_rank(ctx, self, lambda: compare_reload(view, artifact, items, batch, first, second,
                                                              ctx.worker_dir(), Outcome(inputs=inputs), tol))
