"""``batch``: micro batch x accumulation x data replicas = examples per update, and what follows from it.

Written once for every view (:mod:`pilotrun.gates.view`): pilotrun's loop reads its spec, a framework's view its
own arguments (a Trainer's ``TrainingArguments``, a Lightning loader's length).
"""
from __future__ import annotations

from ..batching import batch_plan
from ..ledger.records import GateName
from .base import NEEDS_INTEGRATION, Gate, OnProgram, Outcome, ProbeSite, Product
from .view import TrainingView


def check_batch(view: TrainingView, out: Outcome | None = None) -> Outcome:
    """The batch arithmetic of any view: examples per update, updates per epoch, the last window."""
    out = out or Outcome()
    b = view.batching()
    n = b.examples
    plan = batch_plan(b.micro_batch_size, b.grad_accum_steps, b.replicas, n, b.drop_last,
                      model_parallel=b.model_parallel, tokens_per_example=b.tokens_per_example,
                      micro_steps=b.micro_batches_per_epoch)
    if b.normalisation is not None:
        plan["normalisation"] = b.normalisation
    text = (f"{b.micro_batch_size} x {b.grad_accum_steps} x {b.replicas} replica(s) = "
            f"{plan['examples_per_update']} examples per update; {n} examples -> {plan['updates_per_epoch']} "
            "updates per epoch")
    if b.planned is not None:
        where, updates = b.planned
        epochs = updates / plan["updates_per_epoch"] if plan["updates_per_epoch"] else 0.0
        plan.update(planned_updates=updates, planned_epochs=epochs,
                    planned_examples=updates * plan["examples_per_update"])
        text += f"; {where} {updates} = {epochs:.2f} epochs"
    if b.tokens_per_example is not None:
        text += f"; ~{plan['tokens_per_update']:,.0f} tokens per update"
    last = plan["last_window"]
    if last:
        text += (f"; the last window of each epoch has {last['examples']} examples "
                 f"({last['share_of_full']:.0%} of full), {b.short_window}")
    else:
        text += "; no partial window"
    out.details, out.reason = plan, text
    if plan["examples_per_update"] > n:
        out.warn(f"one update ({plan['examples_per_update']} examples) needs more than the {n} training examples")
    if b.warmup_updates is not None and b.planned is not None and b.warmup_updates >= b.planned[1]:
        out.warn(f"warm-up ({b.warmup_updates} updates) is as long as the run ({b.planned[1]}): "
                 "the peak lr is never reached")
    return out


def probe(view: TrainingView, site: ProbeSite) -> Outcome:
    """The gate on a framework's view, in the program's process (``Gate.probe``)."""
    return check_batch(view)


class BatchGate(Gate):
    name = GateName.BATCH
    on_program = OnProgram.INTEGRATION
    probe = staticmethod(probe)
    watched = True
    program_note = NEEDS_INTEGRATION
    needs = (Product.DATA,)
    uses = (Product.SCAN,)
    carry = True

    def track(self, ctx):
        return []

    def run(self, ctx, meter) -> Outcome:
        return check_batch(ctx.view(), Outcome(inputs={**ctx.base_inputs(), "replicas": ctx.replicas}))
