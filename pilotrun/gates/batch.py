"""``batch``: micro batch x accumulation x data replicas = examples per update, and what follows from it."""
from __future__ import annotations

from ..batching import batch_plan
from ..ledger.records import GateName
from .base import Gate, Outcome, Product


class BatchGate(Gate):
    name = GateName.BATCH
    needs = (Product.DATA,)
    uses = (Product.SCAN,)
    carry = True

    def track(self, ctx):
        return []

    def run(self, ctx, meter) -> Outcome:
        spec, t = ctx.spec, ctx.spec.train
        data = ctx.ensure_data()
        scan = ctx.scan or {}
        n = len(data.train)
        input_tokens = scan.get("input_tokens")
        tokens = input_tokens / n if input_tokens and n else None
        replicas = ctx.replicas
        plan = batch_plan(t.micro_batch_size, t.grad_accum_steps, replicas, n, spec.data.drop_last,
                          model_parallel=max(1, ctx.world_size // replicas), tokens_per_example=tokens)
        epochs = t.updates / plan["updates_per_epoch"] if plan["updates_per_epoch"] else 0.0
        plan["planned_updates"] = t.updates
        plan["planned_epochs"] = epochs
        plan["planned_examples"] = t.updates * plan["examples_per_update"]
        out = Outcome(inputs={**ctx.base_inputs(), "replicas": replicas}, details=plan)
        text = (f"{t.micro_batch_size} x {t.grad_accum_steps} x {replicas} replica(s) = "
                f"{plan['examples_per_update']} examples per update; {n} examples -> {plan['updates_per_epoch']} "
                f"updates per epoch; train.updates {t.updates} = {epochs:.2f} epochs")
        if tokens is not None:
            text += f"; ~{plan['tokens_per_update']:,.0f} tokens per update"
        last = plan["last_window"]
        if last:
            text += (f"; the last window of each epoch has {last['examples']} examples "
                     f"({last['share_of_full']:.0%} of full), a mean over its own examples")
        else:
            text += "; no partial window"
        out.reason = text
        if plan["examples_per_update"] > n:
            out.warn(f"one update ({plan['examples_per_update']} examples) needs more than the {n} training examples")
        if t.scheduler.warmup_updates >= t.updates:
            out.warn(f"warm-up ({t.scheduler.warmup_updates} updates) is as long as the run ({t.updates}): "
                     "the peak lr is never reached")
        return out
