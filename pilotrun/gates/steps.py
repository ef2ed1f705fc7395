"""``first_step`` and ``steady_step``: real updates at the long run's sizes.

The first update allocates optimizer state lazily; from the second on, that state
is live during forward and backward, which is usually the training peak. Both
tracked updates are padded to ``data.max_length`` for built-in tasks, so memory
is measured at the worst shape the long run will meet; the timed updates use the
natural batches, so time per update is what the long run will see.
"""
from __future__ import annotations

import os
import statistics

import torch

from ..drivers import Capability
from ..humanize import human_bytes, human_seconds
from ..ledger.details import SteadyStepDetails
from ..ledger.records import Failure, GateName
from ..procs import HostLoad, explicit_threads, host_load, thread_share
from ..train.compile import DynamoCounts, recompile_warning, summed
from .base import Gate, GateFailure, OnProgram, Outcome, Product

# Warn when the loop waits on data for more than this share of each update, and
# for more than an absolute floor: a 2 ms CPU toy update waiting 0.3 ms is noise.
DATA_WAIT_WARN = 0.10
DATA_WAIT_FLOOR_S = 0.002


def worst_case_length(ctx) -> int | None:
    """The length tracked updates are padded to (built-in tasks), or None when the collate is the user's."""
    if ctx.data is not None and ctx.data.pad_batch is not None:
        return ctx.spec.data.max_length
    return None


def fit_threads() -> int:
    """This process's torch threads, from here on: its share of the cores the others' load leaves it (spinning
    OpenMP threads beside a busy process made the demo's update 10-30 times slower). A count the environment sets
    (the user's, a campaign run's, a gate worker's) wins: torch read it at start."""
    if explicit_threads(os.environ) is None:
        torch.set_num_threads(thread_share(host_load().spare_cpus()))
    return torch.get_num_threads()


def oversubscribed_text(host: HostLoad) -> str | None:
    """The note a timing row carries when the machine had more work than cores while it was timed, else None."""
    if not host.oversubscribed():
        return None
    return (f"timed on an oversubscribed machine (load {host.load_1min:.1f} on the {host.cpus} core(s) this process "
            "may use): the time is partly other processes', not the job's")


def _timing(out: Outcome, threads: int) -> None:
    """The threads the updates ran with and how busy the machine was, in the row; a note (not a verdict) when the
    machine was oversubscribed."""
    host = host_load()
    out.inputs["cpu_threads"] = threads
    out.details["cpu_threads"] = threads
    out.details["host_load_1min"] = host.load_1min
    out.details["host_cpus"] = host.cpus
    note = oversubscribed_text(host)
    out.details["oversubscribed"] = note is not None
    if note:
        out.reason = f"{out.reason}; {note}"


def _inputs(ctx, rec, padded: int | None) -> dict:
    inputs = ctx.base_inputs()
    inputs["seq_len"] = rec.seq_len or inputs.get("seq_len") or None  # None: inputs without a sequence
    inputs["examples_per_update"] = rec.examples * ctx.replicas
    inputs["examples_this_rank"] = rec.examples
    inputs["padded_to_max_length"] = padded is not None
    return inputs


def _failure_inputs(gate, ctx) -> dict:
    """The window being processed when the update failed: its length and size."""
    inputs = ctx.base_inputs()
    window = ctx.model_driver().last_window if ctx.driver is not None else {}
    if window.get("seq_len"):
        inputs["seq_len"] = window["seq_len"]
    if window.get("examples"):
        inputs["examples_per_update"] = window["examples"]
    if window.get("step"):
        inputs["update"] = window["step"]
    return inputs


# The CPU tensor tracker is paused while a compiled model runs (train/compile.py: outside_dispatch_modes).
PAUSED = ("paused while the compiled model ran (dynamo does not compile under a dispatch mode): on CPU the row's "
          "tensor peak misses the update's activations; host RSS still counts them")


def _first_compile(out: Outcome, spent: DynamoCounts, scope: str, paused: bool = False) -> None:
    """train.compile: the first update's compile as its own measurement, so its time is not read as a step's."""
    out.details["compile"] = {"scope": scope, **spent.to_dict()}
    out.reason = (f"{out.reason}; compiled (train.compile: {scope}) in {spent.seconds:.1f} s, {spent.graphs} "
                  "graph(s): this update's time is mostly the compile, steady_step times the compiled steps")
    if paused:
        out.details["compile"]["tensor_tracking"] = PAUSED
    if spent.fell_back:
        out.warn(f"{spent.fell_back} frame(s) fell back to eager in update 1 (dynamo could not compile them: "
                 "graph breaks or its recompile limit): those parts run uncompiled")


def _steady_compile(out: Outcome, spent: DynamoCounts, paused: bool = False) -> None:
    """train.compile: graphs compiled after the first update are recompiles (a new length); their seconds are
    inside the timed updates' mean."""
    out.details["compile"] = {**spent.to_dict(), "recompiles": spent.graphs}
    if paused:
        out.details["compile"]["tensor_tracking"] = PAUSED
    if (words := recompile_warning(spent, "steady steps")) is not None:
        out.warn(words + "; the time per update above includes them")


def _check_params(ctx, step: int) -> None:
    bad = ctx.model_driver().check_parameters_finite()
    if bad is not None:
        raise GateFailure(f"parameter {bad!r} holds inf/NaN after update {step}", failure=Failure.NON_FINITE)


class FirstStepGate(Gate):
    name = GateName.FIRST_STEP
    on_program = OnProgram.STAGE
    program_note = "wrap the first update in `with job.stage(\"first_step\"):`"
    program_problems = True
    program_combines = False
    needs = (Product.DRIVER,)
    produces = (Product.FIRST_UPDATE,)
    requires = (Capability.UPDATES, Capability.MODEL)
    job_memory = True
    carry = True
    shape_in_reason = True

    def failure_inputs(self, ctx) -> dict:
        return _failure_inputs(self, ctx)

    def recover(self, ctx, row) -> bool:
        ctx.first_update = 1
        return True

    def run(self, ctx, meter) -> Outcome:
        driver = ctx.model_driver()
        pad = worst_case_length(ctx)
        threads = fit_threads()
        rec = driver.update(pad_to=pad, strict=True)  # a window that teaches nothing is refused before the step
        _check_params(ctx, rec.step)
        ctx.first_update = rec.step
        opt_bytes = driver.optimizer_state_bytes()
        out = Outcome(inputs=_inputs(ctx, rec, pad), metrics=[rec.metric()])
        out.details = {"loss": rec.loss, "lr": rec.lr, "grad_norm": rec.grad_norm, "optimizer_state_bytes": opt_bytes,
                       "loss_normalization": driver.policy.reason, "sample_ids": rec.sample_ids,
                       "supervised_labels": rec.supervised, "tokens": rec.tokens}
        aux = rec.extra.get("aux_loss")
        if aux is not None:   # a mixture of experts' load-balancing loss (already inside the loss, x its coefficient)
            out.details["aux_loss"] = aux
        gn = f"{rec.grad_norm:.3g}" if rec.grad_norm is not None else "n/a"
        at = f"at length {rec.seq_len}, " if rec.seq_len else ""
        n = (f"{rec.examples} examples" if ctx.replicas == 1 else
             f"{rec.examples} examples on this rank, {rec.examples * ctx.replicas} per update")
        with_aux = f" (incl. the router's load-balancing loss {aux:.4g} x its coefficient)" if aux is not None else ""
        out.reason = (f"update 1 {at}{n}: loss {rec.loss:.4g}{with_aux}, grad norm {gn}, "
                      f"lr {rec.lr:.3g}; optimizer state {human_bytes(opt_bytes)} allocated")
        if (spent := summed([rec.extra])) is not None:
            _first_compile(out, spent, ctx.spec.train.compile, bool(rec.extra.get("tensor_tracking_paused")))
        if rec.scaler_skipped:
            out.warn("the fp16 grad scaler skipped update 1 (inf/NaN gradients at the initial scale): optimizer state "
                     "was not allocated yet, so steady_step holds the first real peak")
        _timing(out, threads)
        return out


class SteadyStepGate(Gate):
    name = GateName.STEADY_STEP
    on_program = OnProgram.STAGE
    program_note = "wrap the later updates in `with job.stage(\"steady_step\"):`"
    program_problems = True
    needs = (Product.FIRST_UPDATE,)
    requires = (Capability.UPDATES, Capability.MODEL)
    job_memory = True
    carry = True
    tensor_tracking = "manual"
    shape_in_reason = True

    def failure_inputs(self, ctx) -> dict:
        return _failure_inputs(self, ctx)

    def run(self, ctx, meter) -> Outcome:
        trainer = ctx.model_driver()
        threads = fit_threads()
        n = ctx.spec.pilot.updates - 1
        pad = worst_case_length(ctx)
        records = []
        ctx.progress(0, n, "updates")
        with meter.track_tensors():
            records.append(trainer.update(pad_to=pad))
        ctx.progress(1, n, "updates")
        for i in range(1, n):
            records.append(trainer.update())
            ctx.progress(i + 1, n, "updates")
        _check_params(ctx, records[-1].step)
        timed = records[1:] or records
        per_update = [r.seconds for r in timed]
        total_s = sum(per_update)
        mean_s = total_s / len(timed)
        wait_share = sum(r.data_wait_s for r in timed) / total_s if total_s else 0.0
        examples_s = sum(r.examples for r in timed) / total_s if total_s else 0.0
        tokens_s = sum(r.tokens for r in timed) / total_s if total_s else 0.0
        out = Outcome(inputs=_inputs(ctx, records[0], pad), metrics=[r.metric() for r in records])
        out.inputs["timed_updates"] = len(timed)
        out.details = SteadyStepDetails(
            seconds_per_update=mean_s,
            median_seconds_per_update=statistics.median(per_update),
            examples_per_second=examples_s,
            tokens_per_second=tokens_s,
            data_wait_seconds_per_update=sum(r.data_wait_s for r in timed) / len(timed),
            data_wait_share=wait_share,
            memory_measured_on_update=records[0].step,
            timed_updates=[r.step for r in timed],
            losses=[r.loss for r in records],
            timed_seq_len_max=max(r.seq_len for r in timed),
            note="one steady update: its time includes tensor-tracking overhead" if len(records) == 1 else None,
        ).to_dict()
        tokens = f"{tokens_s:.0f} tokens/s, " if tokens_s else ""
        at = f" at length {records[0].seq_len}" if records[0].seq_len else ""
        out.reason = (f"{human_seconds(mean_s)}/update over {len(timed)} update(s), {examples_s:.1f} examples/s, "
                      f"{tokens}{wait_share:.0%} waiting on data; memory from update {records[0].step}{at}")
        empty = [r.step for r in records if r.supervised == 0]
        if empty:
            out.warn(f"update(s) {empty} had no supervised labels (all -100): they teach nothing")
        wait_per_update = out.details["data_wait_seconds_per_update"]
        if wait_share > DATA_WAIT_WARN and wait_per_update > DATA_WAIT_FLOOR_S:
            out.warn(f"{wait_share:.0%} of update time is spent waiting on data: raise data.num_workers or "
                     "pre-tokenize, or the GPUs will idle")
        if (spent := summed([r.extra for r in records])) is not None:
            _steady_compile(out, spent, any(r.extra.get("tensor_tracking_paused") for r in records))
        skipped = [r.step for r in records if r.scaler_skipped]
        if skipped and len(skipped) == len(records):
            out.warn(f"the fp16 grad scaler skipped every update ({skipped}): gradients overflow; "
                     "use bf16 or check the loss")
        _timing(out, threads)
        return out
