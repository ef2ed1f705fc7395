"""``reload_eval``: the exported artifact, reloaded in a separate process, reproduces the model's outputs.

Control inputs are the first validation examples. The in-process model runs them
twice in eval mode without reseeding — different outputs mean it is not
deterministic in eval mode (dropout applied regardless of ``model.eval()``). A fresh
process then loads only the artifact (hash-verified) and runs the same inputs.
"""
from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from ..checkpoint.export import MERGED
from ..drivers import Capability
from ..ledger.records import GateName
from ..train.batches import to_device
from ..train.evaluation import outputs_of
from ..workers.launch import run_worker
from .base import Gate, GateFailure, Outcome, Product, on_main_rank

RTOL, ATOL = 1e-4, 1e-5
# A merged export computes (W + s·BA) x instead of W x + s·B(A x): the same sum in another order, whose fp32
# rounding is a few ulps of the outputs' scale per layer, not of each output (an output near 0 gets an error
# of the size of its neighbours'). So the merged model is compared on the outputs' scale: the largest difference
# at most this fraction of the largest output (at least 1). In bf16 each merged weight is itself rounded to 8
# bits of mantissa (2^-8 ≈ 0.4%).
MERGED_SCALE_TOL = {"bf16-true": 2e-2}
MERGED_SCALE_TOL_DEFAULT = 1e-4


class ReloadEvalGate(Gate):
    name = GateName.RELOAD_EVAL
    needs = (Product.DRIVER, Product.EXPORT)
    requires = (Capability.MODEL, Capability.EXPORT)

    def track(self, ctx):
        return [ctx.model] if ctx.model is not None else []

    def run(self, ctx, meter) -> Outcome:
        data = ctx.ensure_data()
        # The model as training runs it (FSDP: every rank takes part in these forwards).
        model = ctx.model_driver().model
        n = min(ctx.spec.eval_batch_size, len(data.val))
        items = [data.val[i] for i in range(n)]
        batch = {k: v.contiguous() for k, v in data.collate(items).items() if isinstance(v, torch.Tensor)}
        was_training = model.training
        try:
            first = outputs_of(model, to_device(batch, ctx.device))
            second = outputs_of(model, to_device(batch, ctx.device))
        finally:
            model.train(was_training)
        return on_main_rank(ctx, self, lambda: self._compare(ctx, batch, items, first, second))

    def _compare(self, ctx, batch, items, first, second) -> Outcome:
        n = len(items)
        work = ctx.worker_dir()
        inputs_path, outputs_path = work / "reload-inputs.safetensors", work / "reload-outputs.safetensors"
        save_file(batch, str(inputs_path))
        out = Outcome(inputs={**ctx.base_inputs(), "control_examples": n, "batch_size": n})
        out.details = {"control_ids": [str(it["id"]) for it in items], "output_shape": list(first.shape),
                       "tolerance": {"rtol": RTOL, "atol": ATOL}}
        if not torch.equal(first, second):
            diff = float((first - second).abs().max())
            raise GateFailure(f"the model is not deterministic in eval mode: the same {n} inputs twice, without "
                              f"reseeding, differ by up to {diff:.3g} — dropout applied regardless of model.eval() "
                              "(F.dropout without training=self.training?) or another unseeded random op",
                              inputs=out.inputs, details=out.details)
        if ctx.export_manifest_sha256 is None:
            raise GateFailure(f"the export in {ctx.export_dir} has no manifest sha256 recorded by its export row: "
                              "it is not loaded (run the export gate again)", inputs=out.inputs, details=out.details)
        # The worker loads the export only if its manifest is the one the export row recorded (not the one on disk
        # now), and imports only the spec's own factory — never one the artifact names.
        args = ["--export", str(ctx.export_dir), "--inputs", str(inputs_path), "--outputs", str(outputs_path),
                "--known-manifest", ctx.export_manifest_sha256]
        if ctx.spec.model.factory:
            args += ["--factory", ctx.spec.model.factory, "--spec-folder", str(ctx.spec.folder)]
        merged_path = work / "reload-merged-outputs.safetensors"
        merged = ctx.spec.model.adapter is not None and (ctx.export_dir / MERGED).is_dir()
        if merged:
            args += ["--merged-outputs", str(merged_path)]
        payload = run_worker("pilotrun.workers.reload", args, work / "reload.json", work / "reload.log", "reload")
        reloaded = load_file(str(outputs_path))["outputs"]
        out.details["reloaded_class"] = payload["model_class"]
        merged_line = ""
        if merged:
            merged_line = self._compare_merged(ctx, load_file(str(merged_path))["outputs"], first, out)
        if reloaded.shape != first.shape:
            raise GateFailure(f"the reloaded artifact returns outputs of shape {tuple(reloaded.shape)}, the model "
                              f"{tuple(first.shape)}", inputs=out.inputs, details=out.details)
        diff = float((reloaded - first).abs().max()) if first.numel() else 0.0
        out.details["max_abs_difference"] = diff
        if not torch.allclose(reloaded, first, rtol=RTOL, atol=ATOL):
            raise GateFailure(f"the reloaded artifact ({payload['model_class']}) does not reproduce the model's "
                              f"outputs on {n} control inputs: max difference {diff:.3g} "
                              f"(rtol {RTOL:g}, atol {ATOL:g}) — "
                              "weights missing from the export, or state the artifact does not carry",
                              inputs=out.inputs, details=out.details)
        what = (f"{payload['model_class']} (the adapter on its rebuilt base, identity checked)"
                if ctx.spec.model.adapter is not None else payload["model_class"])
        out.reason = (f"{what} reloaded from {ctx.export_dir.name}/ in a fresh process reproduces "
                      f"the outputs on {n} control inputs (max difference {diff:.2g}){merged_line}; eval mode is "
                      "deterministic")
        return out

    def _compare_merged(self, ctx, merged: torch.Tensor, first: torch.Tensor, out: Outcome) -> str:
        fraction = MERGED_SCALE_TOL.get(ctx.spec.train.precision, MERGED_SCALE_TOL_DEFAULT)
        scale = max(1.0, float(first.abs().max())) if first.numel() else 1.0
        if merged.shape != first.shape:
            raise GateFailure(f"the merged model returns outputs of shape {tuple(merged.shape)}, the model "
                              f"{tuple(first.shape)}", inputs=out.inputs, details=out.details)
        diff = float((merged - first).abs().max()) if first.numel() else 0.0
        out.details["merged"] = {"max_abs_difference": diff, "output_scale": scale,
                                 "tolerance": f"{fraction:g} x the output scale"}
        if not diff <= fraction * scale:
            raise GateFailure(f"the merged model in {ctx.export_dir.name}/{MERGED}/ does not reproduce the adapter "
                              f"model's outputs: max difference {diff:.3g}, more than {fraction:g} of the outputs' "
                              f"scale {scale:.3g}", inputs=out.inputs, details=out.details)
        return f"; the merged model in {MERGED}/ too (max difference {diff:.2g})"
