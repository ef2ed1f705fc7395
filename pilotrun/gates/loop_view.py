"""pilotrun's own loop as a :class:`~pilotrun.gates.view.TrainingView`: the model-level checks read the spec, the
loop driver and its data through it, exactly as a framework integration's view gives them its own objects.

Built by :meth:`pilotrun.gates.context.PilotContext.view`; cheap, and lazy: ``inspect`` and ``batch`` run before the
``load`` gate built the driver, so only what needs the model asks for it.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch

from .. import strategies
from ..checkpoint.export import BASE_JSON, MERGED, safetensors_tensor_count
from ..drivers import ModelDriver, NonFiniteError
from ..train.batches import IGNORE, autocast_for, dtype_names, half_name, loss_of, to_device
from ..train.evaluation import accuracy_counts, outputs_of, shift_convention
from ..train.fp8 import high_precision_linears, linears_in_high_precision
from ..train.loss import PolicySource, window_backward
from ..train.optim import build_optimizer
from ..train.rng import derived_seed
from . import view
from .view import Artifact, Batching, Exported, OverfitPlan, Reloaded, UpdateIds, Window, WindowKind, tensors_of


def model_label_info(spec, label_names) -> tuple[int | None, dict | None, str]:
    """(number of class outputs, id2label, where from) from the model config, without building the model."""
    m = spec.model
    if m.factory is not None:
        return None, None, "factory model: its output size is checked when first_step runs"
    if m.config is not None:
        cfg = m.config
        id2label = cfg.get("id2label")
        n = cfg.get("num_labels") or (len(id2label) if id2label else None)
        return n, id2label, "model.config"
    try:
        from transformers import AutoConfig

        from ..models.loading import local_path

        local = local_path(m.hf, spec.folder)
        config = AutoConfig.from_pretrained(str(local) if local else m.hf, revision=m.revision,
                                            trust_remote_code=m.trust_remote_code)
    except Exception as exc:  # the load gate reports loading problems in full
        return None, None, f"model config not readable here ({type(exc).__name__})"
    id2label = {int(k): v for k, v in (getattr(config, "id2label", None) or {}).items()}
    trained_head = id2label and not all(v == f"LABEL_{k}" for k, v in id2label.items())
    return (len(id2label) if trained_head else None), (id2label if trained_head else None), "model config"


def adapter_split(spec, label_names) -> dict:
    """Trainable vs frozen parameters of the adapter job, from the model built on the meta device (no weights, no
    memory). Bytes are at the dtype the job holds them in before quantisation; the load row has the bytes as built
    (a 4-bit base's packed weights)."""
    from ..models.adapters import parameter_split
    from ..models.loading import build_model

    built = build_model(spec.model, spec.build_context(), label_names, meta=True, activation_checkpointing=False)
    split = parameter_split(built.model)
    note = ("frozen bytes before quantisation (the load gate measures the quantised base)"
            if spec.model.quantization is not None else "bytes at the dtype the job holds them")
    return {**split.as_dict(), "bytes_note": note}


def windows_of(plan) -> list[Window]:
    """The first window of the data order and epoch 0's last window when it is short, as index lists; with several
    data replicas, the same windows as one process with a replicas-times larger micro batch (one rank checks)."""
    import dataclasses

    if plan.replicas > 1:
        plan = dataclasses.replace(plan, micro_batch_size=plan.global_micro_batch, replicas=1, rank=0)
    order = plan.order(0)
    first = [plan.micro_batch(0, i, order) for i in range(plan.window_size(0))]
    out = [Window(WindowKind.FIRST, "first window", first)]
    last_start = (plan.updates_per_epoch - 1) * plan.grad_accum_steps
    last = [plan.micro_batch(0, i, order) for i in range(last_start, plan.micro_batches_per_epoch)]
    if last_start > 0 and sum(len(b) for b in last) < plan.grad_accum_steps * plan.micro_batch_size:
        out.append(Window(WindowKind.LAST_SHORT, "last, short window", last))
    return out


class LoopUpdater:
    """The overfit copy's update: the loop's own normalisation (``window_backward``), the fp16 scaler, clipping to
    ``train.max_grad_norm``, the spec's optimizer at a constant lr."""

    def __init__(self, model, spec, policy, device, data) -> None:
        self.model, self.spec, self.policy, self.device, self.data = model, spec, policy, device, data
        self.opt = build_optimizer(model, spec.train.optimizer)  # constant lr: the schedule belongs to the long run
        self.scaler = torch.amp.GradScaler(device.type) if spec.train.precision == "fp16" else None

    def update(self, items: list, step: int) -> float:
        # The copy is a plain model in this process alone: the one-process strategy's step, whatever runs the job.
        strategy = strategies.one_process()
        ids = [str(it["id"]) for it in items]
        window = [(ids, self.data.collate(items))]
        model, opt, scaler = self.model, self.opt, self.scaler
        loss = float(window_backward(model, window, self.policy, self.device, self.spec.train.precision, scaler,
                                     backward=strategy.backward)["loss"])
        if not math.isfinite(loss):
            raise NonFiniteError("loss", step, loss, ids)
        norm = strategy.clip_gradients(model.parameters(), self.spec.train.max_grad_norm or None, opt, scaler)
        if scaler is None and norm is not None and not math.isfinite(norm):
            raise NonFiniteError("gradient norm", step, norm, ids)
        strategy.optimizer_step(opt, scaler)
        opt.zero_grad(set_to_none=True)
        return loss


class LoopView(view.ViewBase):
    """See the module docstring. ``export_weights``: the full weights every rank gathered for the export."""

    framework = "pilotrun's loop"
    targets_key: str | None = "labels"
    requires_targets: bool = True   # the factory contract: a batch dict of tensors including 'labels'
    scan_limit: int | None = None
    scoring: str | None = None  # the loop scores each example alone (the factory contract takes a batch of one)
    reference_note: str | None = None  # outputs() runs the model as training holds it
    reference_dtype: torch.dtype | None = None  # set by outputs() under FSDP2's MixedPrecisionPolicy
    reference_device: str = "cpu"  # set by outputs(): where the job's model computed them
    # The loop refuses an item without an id (ContractError), so its updates always carry the items' own.
    update_ids = UpdateIds(False, "pilotrun's loop reports the items' own ids and refuses an item without one")

    def __init__(self, ctx, export_weights: Any = None) -> None:
        self.ctx, self.spec = ctx, ctx.spec
        self.export_weights = export_weights

    # -- data and batching ------------------------------------------------------------------------------
    @property
    def data(self):  # type: ignore[override]  # read only here: the loop's data is the context's, built once
        return self.ctx.ensure_data()

    @property
    def driver(self) -> ModelDriver:
        return self.ctx.model_driver()

    @property
    def shift_labels(self) -> bool:  # type: ignore[override]  # read only here: the driver's loss policy says it
        return self.driver.policy.shift_labels

    def progress(self, done: int, total: int, text: str) -> None:
        self.ctx.progress(done, total, text)

    def batching(self) -> Batching:
        t, ctx = self.spec.train, self.ctx
        n = len(self.data.train)
        tokens = (ctx.scan or {}).get("input_tokens")
        policy = ctx.driver.policy if isinstance(ctx.driver, ModelDriver) else None
        return Batching(t.micro_batch_size, t.grad_accum_steps, ctx.replicas, n, self.spec.data.drop_last,
                        model_parallel=max(1, ctx.world_size // ctx.replicas),
                        tokens_per_example=tokens / n if tokens and n else None,
                        normalisation=policy.reason if policy is not None else None,
                        planned=("train.updates", t.updates), warmup_updates=t.scheduler.warmup_updates)

    def inspect_limits(self) -> tuple[int, float]:
        cfg = self.spec.pilot.inspect
        return cfg.examples, cfg.max_unsupervised_share

    def class_outputs(self) -> tuple[int | None, dict | None, str]:
        return model_label_info(self.spec, self.data.label_names)

    def parameter_split(self) -> dict | None:
        if self.spec.model.adapter is None:
            return None
        from ..models.loading import ModelError

        try:
            return adapter_split(self.spec, self.data.label_names)
        except ModelError as exc:  # the load gate reports the build itself
            return {"not_measured": f"not measured: the model does not build on the meta device ({exc})"}

    # -- the model ----------------------------------------------------------------------------------------
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.driver.plain_model.parameters())

    def float64_problem(self) -> str | None:
        # A bitsandbytes base holds integer weights dequantised to its compute dtype inside each matmul: it has no
        # float64 form, so its copy is checked in float32.
        if getattr(self.driver.loaded, "quantized", False):
            return "the quantised base has no float64 form: float32 copy"
        return None

    def model_copy(self, dtype: torch.dtype | None) -> tuple[torch.nn.Module, torch.device]:
        if dtype is None:
            return self.driver.plain_model_copy(), self.ctx.device
        # fp8: the exact check's copy in high precision (its dynamic float8 scales depend on which examples share a
        # micro batch: float8's rounding, not the loss normalisation the check is about).
        return high_precision_linears(self.driver.plain_model_copy()).to("cpu").to(dtype), torch.device("cpu")

    def accum_windows(self) -> list[Window]:
        data = self.data
        return [Window(w.kind, w.label, [[data.train[i] for i in idx] for idx in w.micro])
                for w in windows_of(self.driver.plan)]

    def accumulate(self, model, micro: list, device: torch.device) -> float:
        window = [([str(it["id"]) for it in items], batch) for items, batch in micro]
        return float(window_backward(model, window, self.driver.policy, device, "fp32")["loss"])

    def one_batch(self, model, batch: dict, device: torch.device) -> float:
        """The reference: the model's own loss on all the window's examples as one batch. Deliberately not the
        loop's code, so a mis-normalising loop cannot agree with itself."""
        policy = self.driver.policy
        batch = to_device(batch, device)
        kwargs = {}
        if policy.pass_num_items:
            labels = batch["labels"][..., 1:] if policy.shift_labels and batch["labels"].ndim >= 2 else batch["labels"]
            kwargs["num_items_in_batch"] = (labels != IGNORE).sum().clamp(min=1)
        loss = loss_of(model(**batch, **kwargs))
        loss.backward()
        return float(loss.detach())

    def normalisation_cause(self, counts: list[int], sizes: list[int]) -> str | None:
        policy = self.driver.policy
        if policy.source is PolicySource.PROBED_IGNORES and len(set(counts)) > 1:
            return ("the model takes num_items_in_batch but ignores it and averages its own micro batch, so tokens in "
                    "micro batches with fewer supervised labels weigh more than in one big batch: divide the summed "
                    "token losses by num_items_in_batch, or declare train.loss_normalization: per_micro_batch on "
                    "purpose")
        if not policy.pass_num_items and len(set(counts)) > 1 and len({c / s for c, s in zip(counts, sizes)}) > 1:
            return ("the loss is a mean over each micro batch's own labels and the micro batches hold different "
                    f"numbers of them ({counts}), so they weigh differently than in one big batch: accept "
                    "num_items_in_batch in forward (sum the token losses and divide by it), or declare "
                    "train.loss_normalization: per_micro_batch on purpose")
        return None

    def declared_per_micro_batch(self) -> bool:
        return self.spec.train.loss_normalization == "per_micro_batch"

    # -- overfit ------------------------------------------------------------------------------------------
    def overfit_plan(self) -> OverfitPlan:
        o = self.spec.pilot.overfit
        return OverfitPlan(o.examples, o.micro_batch_size, o.max_updates, o.check_every, self.spec.train.optimizer.lr,
                           loss_below=o.loss_below, accuracy_at_least=o.accuracy_at_least,
                           loss_below_from=("pilot.overfit.loss_below" if o.loss_below is not None
                                            else "a tenth of the starting loss"),
                           seed=derived_seed(self.spec.seed + 7),
                           budget_hint=" (raise pilot.overfit.max_updates to tell)")

    def overfit_items(self, n: int) -> list:
        order = self.driver.plan.order(0)
        return [self.data.train[i] for i in order[:n]]

    def overfit_updater(self, model, plan: OverfitPlan) -> LoopUpdater:
        return LoopUpdater(model, self.spec, self.driver.policy, self.ctx.device, self.data)

    def target_scores(self, model, items: list) -> tuple[float, float | None]:
        """Mean loss and accuracy of each example alone (its own targets, no neighbours)."""
        data, device, precision = self.data, self.ctx.device, self.spec.train.precision
        losses, correct, counted = [], 0, 0
        shift = shift_convention(model, data)
        model.eval()
        with torch.no_grad(), autocast_for(device, precision):
            for it in items:
                batch = to_device(data.collate([it]), device)
                out = model(**batch)
                losses.append(float(loss_of(out)))
                c, k = accuracy_counts(out, batch["labels"], shift)
                correct, counted = correct + c, counted + k
        model.train()
        return sum(losses) / len(losses), (correct / counted if counted else None)

    def random_base(self, model) -> bool | None:
        # model.hf is pretrained; model.config alone is a random init; a factory's model may be either.
        m = self.spec.model
        return False if m.hf else (True if m.config is not None else None)

    # -- export and reload --------------------------------------------------------------------------------
    def export(self, folder: Path) -> Exported:
        import json

        driver = self.driver
        written = driver.write_export(folder, self.export_weights)
        files = written.files
        trained = driver.step
        adapter = None
        if self.spec.model.adapter is not None:
            base = json.loads((folder / BASE_JSON).read_text())
            adapter = {"base_identity": base.get("base_identity"), "merged": base.get("merged"),
                       "merge_note": base.get("merge_note"), "merge_requested": self.spec.export.merge,
                       "adapter_bytes": files["adapter_model.safetensors"]["bytes"], "merged_folder": MERGED,
                       "merged_bytes": sum(v["bytes"] for k, v in files.items() if k.startswith(f"{MERGED}/"))}
        assert written.manifest_sha256 is not None  # set once the folder is in place: of the bytes written
        return Exported(folder, files, written.total_bytes, written.manifest_sha256,
                        weights=[k for k in files if k.endswith(".safetensors")],
                        tensors=safetensors_tensor_count(folder), adapter=adapter,
                        state=f"after {trained} update(s)" if trained else "as loaded (no update succeeded)")

    def control_items(self) -> list:
        val = self.data.val
        return [val[i] for i in range(min(self.spec.eval_batch_size, len(val)))]

    def outputs(self, batch) -> torch.Tensor:
        # The model as training runs it (FSDP: every rank takes part in these forwards); under fp8 its Linears in
        # high precision, as the export holds them for inference (train/fp8.py).
        model = self.driver.model
        was_training = model.training
        # FSDP2 under bf16/fp16/fp8 gathers the fp32 master weights in the 2-byte dtype for every forward, this one
        # too: the model as training runs it computes in that dtype, and the reload does the same with the export.
        self.reference_dtype = self.driver.strategy.gathered_dtype()
        self.reference_device = self.ctx.device.type
        notes = []
        if self.reference_dtype is not None:
            notes.append(f"FSDP2 computes with its parameters gathered in {half_name(self.reference_dtype)} under "
                         "autocast: the reloaded export's run so too")
        try:
            with linears_in_high_precision(model) as swapped:
                if swapped:
                    notes.append(f"fp8: the model's {swapped} float8 Linears run in high precision, as the export "
                                 "holds them for inference")
                self.reference_note = "; ".join(notes) or None
                # Under the policy, as training runs it: with its autocast (modules outside the blocks, such as a
                # head after a float32 buffer joined the residual stream, take float32 inputs to bf16 weights).
                with (autocast_for(self.ctx.device, self.spec.train.precision) if self.reference_dtype is not None
                      else contextlib.nullcontext()):
                    return outputs_of(model, to_device(tensors_of(batch), self.ctx.device))
        finally:
            model.train(was_training)

    def reload_problem(self, artifact: Artifact) -> str | None:
        return None

    def export_state(self) -> dict[str, torch.Tensor] | None:
        from .reload_eval import export_state_of

        if self.export_weights is not None and self.spec.model.adapter is None:
            return dict(self.export_weights)
        return export_state_of(self.driver.model)

    def reload(self, artifact: Artifact, batch, work: Path) -> Reloaded:
        from safetensors.torch import load_file, save_file

        from ..workers.launch import run_worker

        inputs_path, outputs_path = work / "reload-inputs.safetensors", work / "reload-outputs.safetensors"
        save_file(tensors_of(batch), str(inputs_path))
        assert artifact.manifest_sha256 is not None
        # The worker loads the export only if its manifest is the one the export row recorded (not the one on disk
        # now), and imports only the spec's own factory — never one the artifact names.
        args = ["--export", str(artifact.folder), "--inputs", str(inputs_path), "--outputs", str(outputs_path),
                "--known-manifest", artifact.manifest_sha256]
        if self.spec.model.factory:
            args += ["--factory", self.spec.model.factory, "--spec-folder", str(self.spec.folder)]
        if self.spec.model.trust_remote_code:  # the user's own spec asks; the artifact's base.json never decides
            args += ["--remote-code"]
        if self.reference_dtype is not None:
            args += ["--param-dtype", half_name(self.reference_dtype)]
        merged_path = work / "reload-merged-outputs.safetensors"
        merged = self.spec.model.adapter is not None and (artifact.folder / MERGED).is_dir()
        if merged:
            args += ["--merged-outputs", str(merged_path)]
        payload = run_worker("pilotrun.workers.reload", args, work / "reload.json", work / "reload.log", "reload")
        what = (f"{payload['model_class']} (the adapter on its rebuilt base, identity checked)"
                if self.spec.model.adapter is not None else payload["model_class"])
        # A whole-model export under FSDP2's policy holds the optimizer's masters (the sharded parameters, whatever
        # is gathered); an adapter export's base is rebuilt from the spec, not read from the export.
        masters = None
        if self.reference_dtype is not None and self.spec.model.adapter is None:
            masters = tuple(dtype_names(p for group in self.driver.optimizer.param_groups for p in group["params"]
                                        if p.is_floating_point()))
        return Reloaded(load_file(str(outputs_path))["outputs"], payload["model_class"], what,
                        load_file(str(merged_path))["outputs"] if merged else None,
                        tuple(payload.get("stored_float_dtypes", ())), masters)
