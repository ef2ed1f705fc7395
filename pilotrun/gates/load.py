"""``load``: tokenizer, data and model built, moved to the device and wrapped by the strategy; time and memory.

The driver is built by :func:`pilotrun.drivers.build_driver`, the function every worker process
uses too. On ``--resume`` the driver is then restored from the interrupted run's checkpoint.
"""
from __future__ import annotations

from dataclasses import replace

from ..drivers import build_driver
from ..humanize import human_bytes, human_count
from ..ledger.details import LoadDetails
from ..ledger.records import GateName, Verdict
from ..models.adapters import parameter_split
from ..models.loading import parameter_count
from ..models.quantize import KernelUnavailable
from ..train.batches import dtype_names
from .base import Gate, OnProgram, Outcome, Product


class LoadGate(Gate):
    name = GateName.LOAD
    on_program = OnProgram.STAGE
    program_note = "wrap the model loading in `with job.stage(\"load\"):`"
    needs = (Product.DATA,)
    produces = (Product.DRIVER,)
    job_memory = True

    def track(self, ctx):
        return []

    def run(self, ctx, meter) -> Outcome:
        spec = ctx.spec
        data = ctx.ensure_data()
        assert ctx.inputs is not None
        try:
            driver = build_driver(spec, ctx.inputs, ctx.process, on_model=lambda m: meter.register([m]))
        except KernelUnavailable as exc:  # never a fake pass: the gates after this one are skipped with the reason
            return Outcome(Verdict.SKIP, exc.reason, inputs=self.describe_inputs(ctx),
                           details={"not_measured": exc.reason, "operation": exc.kernel.value})
        ctx.driver = driver
        restored = driver.restore(ctx.restore_from) if ctx.restore_from is not None else None
        if restored is not None:
            ctx.first_update = 1  # the checkpoint's optimizer state is live again
        md = ctx.model_driver()
        model, loaded, policy = md.plain_model, md.loaded, md.policy
        total, trainable = parameter_count(model)
        dtypes = dtype_names(model.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        env = ctx.env
        ratio = md.reduction_ratio
        out = Outcome(inputs=self.describe_inputs(ctx))
        details = LoadDetails(
            model_class=type(model).__name__,
            source=loaded.source,
            head=loaded.head,
            parameters=total,
            trainable_parameters=trainable,
            parameter_bytes=param_bytes,
            parameter_dtypes=dtypes,
            device_choice=ctx.process.device_reason,
            loss_normalization=policy.reason,
            data_sizes=data.sizes(),
            label_names=data.label_names,
            notes=loaded.notes + data.notes,
            updates_per_epoch=md.plan.updates_per_epoch,
            strategy=driver.how_wrapped,
            gradient_reduction=("one process" if not env.active else
                                f"measured: the {ctx.strategy.name} reduction "
                                f"{'averages' if abs(ratio - 1) < 1e-6 else 'sums'} gradients over ranks "
                                f"(ratio {ratio:g}); losses scaled by {md.grad_scale:g}"),
            examples_per_update=spec.train.micro_batch_size * spec.train.grad_accum_steps * ctx.replicas,
            optimizer={"name": md.optimizer_choice.name, "fused": md.optimizer_choice.fused,
                       "reason": md.optimizer_choice.reason} if hasattr(md, "optimizer_choice") else None,
            precision=spec.train.precision,
            restored_from=str(ctx.restore_from) if restored is not None else None,
            restored_step=restored["step"] if restored is not None else None,
        )
        split = parameter_split(model)
        if loaded.base_identity is not None:  # an adapter: what trains, what is frozen, and which base
            details = replace(details, **split.as_dict(), base_identity=loaded.base_identity)
        out.details = details.to_dict()
        sizes = ", ".join(f"{k} {v}" for k, v in data.sizes().items())
        per_update = spec.train.micro_batch_size * spec.train.grad_accum_steps
        out.reason = (
            f"{type(model).__name__}: {human_count(total)} parameters ({human_bytes(param_bytes)} {'/'.join(dtypes)}) "
            f"from {loaded.source.split(' (')[0]} on {ctx.device}; {sizes} examples; loss over accumulation: "
            + ("num_items_in_batch passed" if policy.pass_num_items else "per-micro-batch means weighted by examples")
        )
        if loaded.base_identity is not None:
            out.reason += (f"; adapter: {human_count(split.trainable)} trainable ({human_bytes(split.trainable_bytes)},"
                           f" {split.trainable_share:.2%}), {human_count(split.frozen)} frozen "
                           f"({human_bytes(split.frozen_bytes)})")
        if env.active:
            out.reason += f"; {driver.how_wrapped}"
        if restored is not None and ctx.restore_from is not None:
            out.reason += f"; training state restored from {ctx.restore_from.name} (update {restored['step']})"
        if len(data.train) < per_update:
            out.warn(f"the train split has {len(data.train)} examples, fewer than one update window "
                     f"({spec.train.micro_batch_size} x {spec.train.grad_accum_steps} = {per_update}): every update "
                     "is a short window of the same examples")
        return out
