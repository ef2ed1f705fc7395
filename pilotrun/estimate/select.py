"""The selection sheet: per accelerator, the configuration that fits with headroom and what it costs.

Pure logic over traces and the catalog; the CLI prints it as a table, markdown or JSON.
"""
from __future__ import annotations

import math

from .. import strategies
from ..config.sections import ac_policy, ac_variant, ac_words
from ..ledger.records import GateName
from .catalog import Accelerator, matches
from .experiments import adapter_view, label
from .measured import measured_fixes, seconds_with_recompute
from .model import estimate_fit, largest_scale_that_fits, time_source
from .runner import calibrated_utilisation


def _divisors_at_most(n: int, limit: int) -> int:
    best = 1
    for d in range(1, min(n, max(1, limit)) + 1):
        if n % d == 0:
            best = d
    return best


def _verified_by(ledger, acc: Accelerator) -> str | None:
    if ledger is None:
        return None
    for run in ledger.runs(limit=500):
        for row in ledger.gate_rows(run["run_id"]):
            if row["gate"] == GateName.STEADY_STEP and row["verdict"] in ("pass", "warn") and \
                    matches(acc, row["inputs"].get("device_name")):
                return f"pilot {run['run_id']}"
    return None


def choose(spec, traces, acc: Accelerator, headroom: float) -> tuple[dict, dict, list[str]]:
    """(trace, fit, steps taken): the first configuration in the fix order (docs/architecture.md, "Contracts")
    that fits with headroom."""
    steps: list[str] = []
    budget = acc.memory_bytes * (1 - headroom)
    spec_ac = spec.train.activation_checkpointing
    one, shard = strategies.one_process().name, strategies.sharding().name
    options = [(one, 1, False)] + ([(one, 1, True)] if not spec_ac else [])
    options += [(shard, n, ac) for n in (2, 4, 8) for ac in ((False, True) if not spec_ac else (True,))]
    for strategy, gpus, ac in options:
        # A spec that checkpoints keeps its own policy (selective-N, every-N...): the sheet never swaps it for full.
        trace = traces.get(ac=True) if ac and not spec_ac else traces.get()
        fit = estimate_fit(trace, acc, strategy, gpus)
        label = f"{strategy}{'' if gpus == 1 else f' x{gpus}'}{' + activation checkpointing' if ac else ''}"
        if fit["device_used_bytes"] <= budget:
            steps.append(f"{label}: fits ({fit['device_used_bytes'] / 2**30:.1f} of "
                         f"{acc.memory_bytes / 2**30:.0f} GiB)")
            return trace, fit, steps
        # a smaller micro batch (examples per update held) before adding GPUs
        scale = largest_scale_that_fits(trace, acc, strategy, gpus, headroom)
        mb = spec.train.micro_batch_size
        if scale * mb >= 1:
            small = _divisors_at_most(mb * spec.train.grad_accum_steps, int(scale * mb))
            fit = estimate_fit(trace, acc, strategy, gpus, micro_scale=small / mb)
            steps.append(f"{label}: fits with micro batch {small}")
            fit["micro_batch_size"] = small
            return trace, fit, steps
        steps.append(f"{label}: does not fit ({fit['device_used_bytes'] / 2**30:.1f} GiB needed)")
    return trace, fit, steps


def _measured_recompute(spec, traces, trace: dict, acc: Accelerator, strategy: str, gpus: int,
                        util: float | None, scale: float, ledger, micro_batches: int) -> tuple[float, str] | None:
    """The time per update with checkpointing as ``pilotrun variants`` measured it on this accelerator (the same
    configuration without checkpointing x the measured ratio) and the step saying so; None when nothing measured
    the trace's policy, or when it was measured on another device (the FLOPs ratio stands)."""
    policy = ac_policy(trace["activation_checkpointing"])
    measured = measured_fixes(ledger, spec.pilot_hash()) if policy else None
    if policy is None or measured is None:
        return None
    ratio, said = measured.time_factor(ac_variant(policy), acc)
    s = (seconds_with_recompute(traces, acc, strategy, gpus, util, scale, ratio, micro_batches=micro_batches,
                                lengths=traces.lengths())
         if ratio is not None else None)
    return (s, f"{ac_words(policy)}: {said}, instead of the FLOPs ratio") if s else None


def sheet_row(spec, traces, acc: Accelerator, ledger, extensions, headroom: float | None = None) -> dict:
    from .stack import stack_status

    headroom = float(acc.defaults.get("headroom", 0.05)) if headroom is None else headroom
    trace, fit, steps = choose(spec, traces, acc, headroom)
    t = spec.train
    gpus, strategy = fit["gpus"], fit["strategy"]
    replicas = strategies.get(strategy).data_replicas(gpus)
    examples = t.micro_batch_size * t.grad_accum_steps
    scale = largest_scale_that_fits(trace, acc, strategy, gpus, headroom)
    max_mb = max(0, math.floor(t.micro_batch_size * scale))
    max_len = max(0, math.floor((spec.data.max_length or 0) * scale))
    capped = trace.get("max_positions") and max_len > trace["max_positions"]
    if capped:
        max_len = int(trace["max_positions"])
    mb = fit.get("micro_batch_size") or min(t.micro_batch_size, max(1, max_mb))
    per_rank = max(1, examples // replicas)
    mb = _divisors_at_most(per_rank, mb)
    accum = max(1, per_rank // mb)
    util, util_source = calibrated_utilisation(ledger, spec.pilot_hash(), acc,
                                               trace["stages"][GateName.STEADY_STEP]["flops"], t.precision)
    fit = estimate_fit(trace, acc, strategy, gpus, utilisation=util, micro_scale=mb / t.micro_batch_size,
                       micro_batches=accum, lengths=traces.lengths())  # the row's own micro batches per GPU
    s = fit["seconds_per_update"] if fit["fits"] else None
    recompute = None
    if s is not None and (said := _measured_recompute(spec, traces, trace, acc, strategy, gpus, util,
                                                      mb / t.micro_batch_size, ledger, accum)):
        s, recompute = said
        steps.append(recompute)
    verified = _verified_by(ledger, acc)
    return {
        "accelerator": acc.name,
        "memory_per_device_bytes": acc.memory_bytes,
        "fits": fit["fits"],
        "strategy": strategy,
        "gpus": gpus,
        "precision": t.precision,
        "activation_checkpointing": trace["activation_checkpointing"],
        "micro_batch_size": mb,
        "grad_accum_steps": accum,
        "examples_per_update": mb * accum * replicas,
        "examples_per_update_held": mb * accum * replicas == examples,
        "largest_micro_batch": max_mb,
        "largest_length": max_len,
        "largest_length_at_micro_batch": t.micro_batch_size,  # the length scales alone, at the spec's micro batch
        "largest_sizes_note": ("activations scale linearly with micro batch and with length (flash/efficient attention)"
                               + (f"; length capped at the model's max_position_embeddings ({max_len})"
                                  if capped else "")),
        "price_per_gpu_hour": acc.price_per_gpu_hour,
        "spot_price_per_gpu_hour": acc.spot_price_per_gpu_hour,
        "stack": acc.stack,                       # cuda or rocm: which torch build the node needs
        "skypilot": acc.skypilot,                 # SkyPilot's name for it ("" when the catalog has none)
        "gpus_per_node": int(acc.interconnect.get("gpus_per_node") or 8),
        "cost_per_update": acc.cost(s / 3600 if s else None, gpus),
        "cost_for_planned_updates": acc.cost(s * t.updates / 3600 if s else None, gpus),
        "cost_note": acc.price_note(),
        "device_used_bytes": fit["device_used_bytes"],
        "seconds_per_update": s,
        # Why a configuration that fits has no time (an accelerator with no peak for the precision): said in the
        # table, not only in the JSON.
        "time_reason": fit["time"].get("reason") if fit["fits"] and s is None else None,
        "hours_for_planned_updates": s * t.updates / 3600 if s else None,
        "utilisation": fit["time"].get("utilisation"),
        "utilisation_source": time_source(fit["time"], util_source if util else None),
        "utilisation_measured": util is not None,
        # Which lengths the time is at: the data's (a sample of its file, padded per micro batch) or the longest.
        "time_lengths": fit["time_lengths"],
        # The checkpointing recompute `pilotrun variants` measured on this accelerator, when the time uses it.
        "measured_recompute": recompute,
        "bound": fit["time"].get("bound"),
        "software_stack": stack_status(acc, verified, extensions),
        "steps": steps,
        "notes": acc.notes,
        "experiment": label(spec),
        "adapter": adapter_view(trace, spec),
    }
