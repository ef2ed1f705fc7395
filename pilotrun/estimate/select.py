"""The selection sheet: per accelerator, the configuration that fits with headroom and what it costs.

Pure logic over traces and the catalog; the CLI prints it as a table, markdown or JSON.
"""
from __future__ import annotations

import math
from dataclasses import replace

from .. import strategies
from ..config.sections import ac_policy, ac_variant, ac_words
from ..ledger.records import GateName, Verdict
from .catalog import Accelerator, matches
from .experiments import adapter_view, label
from .fp8 import CASTS, fp8_trace, why_none
from .measured import measured_fixes, seconds_with_recompute
from .model import estimate_fit, largest_scale_that_fits, seconds_per_update, time_source
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
        for row in ledger.gate_records(run["run_id"]):
            if row.gate == GateName.STEADY_STEP and row.verdict in (Verdict.PASS, Verdict.WARN) and \
                    matches(acc, row.inputs.get("device_name")):
                return f"pilot {run['run_id']}"
    return None


# The most nodes the sheet tries (sharding over MAX_NODES x gpus_per_node GPUs): beyond it a full fine-tune is a job
# for tensor or pipeline parallelism, which the estimate does not model; said in the "does not fit" steps.
MAX_NODES = 16


def gpus_per_node(acc: Accelerator) -> int:
    """The catalog's ``interconnect.gpus_per_node`` (8 where it says none: the usual rented node)."""
    return max(1, int(acc.interconnect.get("gpus_per_node") or 8))


def gpu_counts(acc: Accelerator) -> list[int]:
    """The sharded GPU counts tried, smallest first: 2, 4, 8 within a node (as many as it holds), then whole nodes
    of ``gpus_per_node``: 2, 4, 8, 16 of them (MAX_NODES). Powers of two keep the examples per update divisible."""
    per_node = gpus_per_node(acc)
    within = [n for n in (2, 4, 8) if n <= per_node]
    if per_node > 1 and per_node not in within:
        within.append(per_node)
    nodes = [2 ** i for i in range(1, MAX_NODES.bit_length()) if 2 ** i <= MAX_NODES]
    return within + [per_node * n for n in nodes]


def with_inter_node(acc: Accelerator, gb_s: float, source: str) -> Accelerator:
    """``acc`` with the link between nodes at ``gb_s`` GB/s per GPU (the rental's figure, e.g. --inter-node-gb-s),
    ``source`` saying where it came from; the catalog's own figure is replaced."""
    return replace(acc, interconnect={**acc.interconnect, "inter_node_gb_s": gb_s, "inter_node_source": source})


def inter_node(acc: Accelerator) -> dict:
    """The link between nodes as a row says it: {gb_s, from, lower_bound}. Unknown (no figure in the catalog, no
    flag): the collectives are timed at the intra-node link, so the time is a lower bound
    (model.collective_bandwidth)."""
    gb_s = acc.interconnect.get("inter_node_gb_s")
    if not gb_s:
        return {"gb_s": None, "lower_bound": True,
                "from": f"unknown: the catalog has no interconnect.inter_node_gb_s for {acc.name} and no "
                        "--inter-node-gb-s was given; timed at the intra-node link, so the time is a lower bound"}
    source = acc.interconnect.get("inter_node_source") or "the catalog's interconnect.inter_node_gb_s"
    return {"gb_s": float(gb_s), "lower_bound": False, "from": source}


def node_count(gpus: int, per_node: int) -> int:
    """The nodes ``gpus`` GPUs take, ``per_node`` to a node (the last one may be part full)."""
    return -(-gpus // per_node)


def config_label(strategy: str, gpus: int, per_node: int, ac: bool = False) -> str:
    """"fsdp x4", "fsdp x16 (2 nodes x 8)": a configuration as the sheet's steps and the plan say it."""
    nodes = node_count(gpus, per_node)
    count = "" if gpus == 1 else f" x{gpus}" + (f" ({nodes} nodes x {per_node})" if nodes > 1 else "")
    return f"{strategy}{count}{' + activation checkpointing' if ac else ''}"


def choose(spec, traces, acc: Accelerator, headroom: float) -> tuple[dict, dict, list[str]]:
    """(trace, fit, steps taken): the first configuration in the fix order (docs/architecture.md, "Contracts")
    that fits with headroom: one GPU, then sharding over more of them, node by node beyond one (gpu_counts)."""
    steps: list[str] = []
    budget = acc.memory_bytes * (1 - headroom)
    spec_ac = spec.train.activation_checkpointing
    one, shard = strategies.one_process().name, strategies.sharding().name
    per_node = gpus_per_node(acc)
    options = [(one, 1, False)] + ([(one, 1, True)] if not spec_ac else [])
    options += [(shard, n, ac) for n in gpu_counts(acc) for ac in ((False, True) if not spec_ac else (True,))]
    for strategy, gpus, ac in options:
        # A spec that checkpoints keeps its own policy (selective-N, every-N...): the sheet never swaps it for full.
        trace = traces.get(ac=True) if ac and not spec_ac else traces.get()
        fit = estimate_fit(trace, acc, strategy, gpus)
        label = config_label(strategy, gpus, per_node, ac)
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
    steps.append(f"nothing larger is tried: at most {MAX_NODES} nodes of {per_node} ({MAX_NODES * per_node} GPUs) "
                 "sharded with FSDP; beyond that the job needs tensor or pipeline parallelism, not modelled")
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


# The precisions FP8 training is read against: its matmuls replace bf16 ones (a job in fp32 or fp16 would compare
# two changes at once: bf16 comes first, as in docs/guides/fix-memory.md's order).
FP8_BASES = ("bf16", "bf16-true", "bf16-true-autocast")
# FlashAttention-3 (Hopper only): the estimate times attention by its FLOPs and bytes, the same for FA2 and FA3.
FA3_NOTE = ("FlashAttention-3 (Hopper): not modelled: the estimate times flash_attention_2 and flash_attention_3 "
            "alike (the same FLOPs and bytes at the same efficiency); measure it with pilotrun variants (custom: "
            "{fa3: {model.attn_implementation: flash_attention_3}}) on the H100")


def fp8_path(spec, traces, trace: dict, acc: Accelerator, config: tuple[str, int, float, int],
             ledger) -> dict | None:
    """Whether FP8 training (torchao float8, estimate/fp8.py) would make this row's update faster on ``acc``, by how
    much, and whether measured (``pilotrun variants`` ran fp8 on this accelerator) or predicted. None where ``acc``
    has no FP8 (no fp8 peak in the catalog): such a row gets no FP8 path. ``config``: (strategy, GPUs, micro scale,
    micro batches per GPU) of the row."""
    if not acc.peak_flops("fp8"):
        return None
    p = spec.train.precision
    row: dict = {"path": "fp8", "recipe": spec.train.fp8_recipe, "factor": None, "eager_factor": None,
                 "source": None, "faster": None}
    if p == "fp8":
        return {**row, "note": "the job trains in fp8: the row's time is FP8's"}
    if p not in FP8_BASES:
        return {**row, "note": f"FP8 is read against bf16 and the job trains in {p}: estimate it with "
                               "train.precision: bf16 to see the FP8 path"}
    measured = measured_fixes(ledger, spec.pilot_hash())
    ratio, said = measured.time_factor("fp8", acc) if measured is not None else (None, "")
    if ratio is not None:
        return {**row, "factor": ratio, "source": "measured", "faster": ratio < 1,
                "note": f"fp8: {said} (pilotrun variants: eager casts, pilotrun's loop)"}
    strategy, gpus, micro_scale, accum = config
    timed: dict[str, float] = {}
    for casts in ("base", *CASTS):
        converted = trace if casts == "base" else fp8_trace(trace, casts)
        if converted is None:
            return {**row, "note": f"fp8: {why_none(trace)}"}
        seconds = seconds_per_update(converted, acc, strategy, gpus, "fp8" if casts != "base" else p,
                                     micro_scale=micro_scale, micro_batches=accum,
                                     lengths=traces.lengths()).get("seconds")
        if not seconds:
            return {**row, "note": f"fp8: no time on {acc.name} (the catalog lacks a figure the time model needs)"}
        timed[casts] = seconds
    fused, eager = timed["fused"] / timed["base"], timed["eager"] / timed["base"]
    linears = (trace.get("fp8") or {}).get("linears")
    return {**row, "factor": fused, "eager_factor": eager, "source": "predicted", "faster": fused < 1,
            "note": f"x{fused:.2f} (x{eager:.2f} eager)",
            "about": f"the time per update x the factor: {linears} Linears' matmuls at the FP8 peak ("
                     f"{spec.train.fp8_recipe}), their float8 casts fused as torch.compile runs them (in brackets: "
                     "eager casts, as pilotrun's own loop runs them; estimate/fp8.py). Its numerics: pilotrun "
                     "variants with pilot.variants.run: [fp8]"}


def faster_paths(spec, traces, trace: dict, acc: Accelerator, config: tuple[str, int, float, int],
                 ledger) -> list[dict]:
    """The accelerator's paths that may make this job faster (docs/guides/choose-accelerator.md, "Faster paths"):
    FP8 where the catalog gives an fp8 peak, FlashAttention-3 on Hopper (compute capability 9.0)."""
    paths = [p for p in [fp8_path(spec, traces, trace, acc, config, ledger)] if p is not None]
    if acc.compute_capability.startswith("9."):
        paths.append({"path": "flash_attention_3", "factor": None, "eager_factor": None, "source": None,
                      "faster": None, "note": FA3_NOTE})
    return paths


def _cluster(acc: Accelerator, gpus: int) -> dict:
    """A row's nodes: GPUs per node, how many nodes, and, across nodes, the link the collectives run at (from the
    catalog or --inter-node-gb-s; unknown: a lower bound)."""
    per_node = gpus_per_node(acc)
    return {"gpus_per_node": per_node, "nodes": node_count(gpus, per_node),
            "inter_node": inter_node(acc) if gpus > per_node else None}


def _batch_note(acc: Accelerator, row_examples: int, replicas: int, examples: int) -> str | None:
    """Said where the examples per update moved: more data replicas than the spec's examples take one each."""
    if row_examples == examples:
        return None
    return (f"{acc.name}: {row_examples} examples per update over {replicas} data replicas, not the spec's "
            f"{examples} (a replica takes at least one example): a larger batch, another experiment")


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
    paths = faster_paths(spec, traces, trace, acc, (strategy, gpus, mb / t.micro_batch_size, accum), ledger) \
        if fit["fits"] else []
    return {
        "accelerator": acc.name,
        "memory_per_device_bytes": acc.memory_bytes,
        "fits": fit["fits"],
        "strategy": strategy,
        "gpus": gpus, **_cluster(acc, gpus),   # nodes of gpus_per_node, the link between them
        "precision": t.precision,
        "activation_checkpointing": trace["activation_checkpointing"],
        "micro_batch_size": mb,
        "grad_accum_steps": accum,
        "examples_per_update": mb * accum * replicas,
        "examples_per_update_held": mb * accum * replicas == examples,
        "batch_note": _batch_note(acc, mb * accum * replicas, replicas, examples),
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
        # What may make the update faster here (fp8, FlashAttention-3), each measured, predicted or not modelled.
        "faster_paths": paths,
    }


def path_cell(row: dict) -> str:
    """The sheet's "faster path" cell: the FP8 path's time factor and whether measured or predicted ("fp8 x0.91
    predicted"); "fp8 n/a" where FP8 has no figure; "—" where the accelerator has no FP8."""
    fp8 = next((p for p in row.get("faster_paths") or [] if p["path"] == "fp8"), None)
    if fp8 is None:
        return "—"
    if fp8["factor"] is None:
        return "fp8 n/a"
    return f"fp8 x{fp8['factor']:.2f} {fp8['source']}"


def path_notes(rows: list[dict]) -> list[str]:
    """The faster paths' notes: the predicted FP8 factors on one line (what they count, then each accelerator's),
    every other note once, after the accelerators it is said of ("H100-80GB, H200-141GB: FlashAttention-3 ...")."""
    predicted: dict[str, list[str]] = {}
    by_note: dict[str, list[str]] = {}
    for r in rows:
        for p in r.get("faster_paths") or []:
            if p.get("about"):
                predicted.setdefault(p["about"], []).append(f"{r['accelerator']} {p['note']}")
            else:
                by_note.setdefault(p["note"], []).append(r["accelerator"])
    return ([f"fp8 path, predicted: {', '.join(said)}; {about}" for about, said in predicted.items()]
            + [f"{', '.join(dict.fromkeys(accs))}: {note}" for note, accs in by_note.items()])
