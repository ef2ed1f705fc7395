"""``load``: tokenizer, data and model built and moved to the device; time and memory."""
from __future__ import annotations

from .. import distributed
from ..checkpoint.state import restore_training_state
from ..models.loading import build_model, parameter_count
from ..train.loop import Trainer, seed_everything
from ..ui.format import human_bytes, human_count
from .base import Gate, Outcome


class LoadGate(Gate):
    name = "load"
    needs_data = True

    def track(self, ctx):
        return []

    def run(self, ctx, meter) -> Outcome:
        spec = ctx.spec
        seed_everything(spec.seed)
        data = ctx.ensure_data()
        loaded = build_model(spec, data.label_names, ctx.tokenizer)
        model = loaded.model.to(ctx.device)
        ctx.loaded = loaded
        meter.register([model])
        env = ctx.env or distributed.DistEnv()
        ratio = distributed.reduction_ratio(env, ctx.device)
        wrapped, how = distributed.wrap(model, env, ctx.device)
        ctx.trainer = Trainer(wrapped, data.train, data.collate, spec, ctx.device, pad_batch=data.pad_batch,
                              env=env, reduction_ratio=ratio)
        policy = ctx.trainer.probe_policy()
        restored = None
        if ctx.resume_checkpoint is not None:
            restored = restore_training_state(ctx.trainer, ctx.resume_checkpoint)
        total, trainable = parameter_count(model)
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
        param_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        out = Outcome(inputs=self.describe_inputs(ctx))
        out.details = {
            "model_class": type(model).__name__,
            "source": loaded.source,
            "head": loaded.head,
            "parameters": total,
            "trainable_parameters": trainable,
            "parameter_bytes": param_bytes,
            "parameter_dtypes": dtypes,
            "device_choice": ctx.device_reason,
            "loss_normalization": ctx.trainer.policy.reason,
            "data_sizes": data.sizes(),
            "label_names": data.label_names,
            "notes": loaded.notes + data.notes,
            "updates_per_epoch": ctx.trainer.plan.updates_per_epoch,
            "strategy": how,
            "gradient_reduction": ("one process" if not env.active else
                                   f"measured: the {env.strategy} reduction {'averages' if abs(ratio - 1) < 1e-6 else 'sums'}"
                                   f" gradients over ranks (ratio {ratio:g}); losses scaled by {ctx.trainer.grad_scale:g}"),
            "examples_per_update": spec.train.micro_batch_size * spec.train.grad_accum_steps * env.world_size,
        }
        sizes = ", ".join(f"{k} {v}" for k, v in data.sizes().items())
        if restored is not None:
            out.details["restored_from"] = str(ctx.resume_checkpoint)
            out.details["restored_step"] = restored["step"]
        per_update = spec.train.micro_batch_size * spec.train.grad_accum_steps
        out.reason = (
            f"{type(model).__name__}: {human_count(total)} parameters ({human_bytes(param_bytes)} {'/'.join(dtypes)}) "
            f"from {loaded.source.split(' (')[0]} on {ctx.device}; {sizes} examples; loss over accumulation: "
            + ("num_items_in_batch passed" if policy.pass_num_items else "per-micro-batch means weighted by examples")
        )
        if env.active:
            out.reason += f"; {how}"
        if restored is not None:
            out.reason += f"; training state restored from {ctx.resume_checkpoint.name} (update {restored['step']})"
        if len(data.train) < per_update:
            out.warn(f"the train split has {len(data.train)} examples, fewer than one update window "
                     f"({spec.train.micro_batch_size} x {spec.train.grad_accum_steps} = {per_update}): every update "
                     "is a short window of the same examples")
        return out
