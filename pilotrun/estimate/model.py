"""From one fake-tensor trace to per-rank memory and time on a target accelerator: pure functions.

The trace is taken on the CPU; everything that differs on the target is a named
correction with its size, so a person can see what the estimate assumed:

* allocator rounding — each storage rounded up to 512 B (measured in the trace);
* library workspaces — cuBLAS / hipBLASLt workspace per handle (catalog);
* reserved-over-allocated margin — fragmentation of the caching allocator (catalog default);
* runtime context — the CUDA/HIP context outside the allocator (catalog);
* collective buffers — NCCL/RCCL per communicator, only with more than one GPU (catalog);
* strategy — DDP's gradient buckets; FSDP2's shards and the unsharded layer in flight; with CPU offload the
  shards on the host, the host memory per node and the host's time (``offload.py``);
* attention kernels, autocast op lists and the optimizer's foreach path — see ``_kernel_notes``.

Example::

    est = estimate_fit(trace, catalog["H100-80GB"], "fsdp", 4)
    est["peak_allocated_bytes"], est["fits"], est["seconds_per_update"]
"""
from __future__ import annotations

import math

from .. import strategies
from ..ledger.records import TRAINING_GATES, GateName
from ..models.attention import AS_TRACED_ON_CPU
from ..strategies import StageBytes, correction
from .alignment import SHOWN_MODULES, short, unaligned_view
from .catalog import Accelerator
from .compiled import compiled_trace
from .compiled import note as compiled_note
from .fp8 import MEMORY_NOTE, fp8_trace, why_none
from .lengths import AtLengths, DataLengths, expected_micro
from .moe import note as moe_note
from .offload import host_memory, offload_notes, offload_time, placed_strategy
from .ops import roofline_seconds

# The traced stages are the estimates of these gates' rows (bench/estimate_accuracy.py compares them by name).
STAGES = (GateName.FIRST_STEP, GateName.STEADY_STEP, GateName.EVAL)


def _kernel_notes(trace: dict) -> list[dict]:
    """Corrections that the trace already carries; listed with their size so none is silent."""
    step = trace["stages"][GateName.STEADY_STEP]
    foreach = trace.get("foreach", True)
    path = trace.get("optimizer") or ""
    if foreach:
        how = ("traced with foreach=True as CUDA/ROCm run AdamW and SGD by default: the size is its step temporaries, "
               "already inside the traced peak")
    elif "fused" in path:
        how = f"traced as it runs on the target: {path}"
    else:
        how = f"traced without foreach: {path or 'the per-parameter path'}"
    return [
        correction("optimizer foreach path", step.get("optimizer_step_extra_bytes", 0) if foreach else 0, "allocated",
                   how),
        correction("attention kernels", 0, "allocated", attention_note(trace.get("attention") or {})),
        correction("autocast op lists", 0, "allocated",
           "CPU and CUDA autocast run matmul, linear, bmm and attention in the lower precision; CUDA's fp32 list "
           "(softmax, log_softmax, norms, pow, sum, the losses) is applied to the CPU trace for a GPU target "
           "(estimate/autocast_lists.py); the weight-cast cache exists on both"),
    ] + ([correction("FP8 casts (torchao float8)", 0, "allocated", MEMORY_NOTE)] if trace.get("precision") == "fp8"
         else []) + ([correction("mixture of experts", 0, "allocated",
                                 moe_note(trace["moe"], trace.get("precision", "")))] if trace.get("moe") else []) + (
        [_compile_correction(trace)] if trace.get("compiled") else [])


def _compile_correction(trace: dict) -> dict:
    """train.compile's row: the bytes the compiled graph saves less than eager per micro batch (already off the
    activations, estimate/compiled.py) and what was modelled."""
    less, how = compiled_note(trace)
    return correction("torch.compile", -less, "allocated", how)


def attention_note(att: dict) -> str:
    """Which attention kernel the trace modelled and why, for the "attention kernels" row (models/attention.py)."""
    if not att:
        return ("not recorded: a trace written before pilotrun modelled the target's attention kernel (trace again "
                "with --no-trace-cache)")
    impl, kernel, calls = att.get("implementation", "?"), att.get("kernel", "?"), att.get("calls", 0)
    if kernel == AS_TRACED_ON_CPU:
        return f"{impl}: traced {kernel} (the target is this CPU: its own dispatch is what runs)"
    if impl == "eager":
        return ("eager attention (model.attn_implementation or the model's config): traced as the model computes it, "
                "its L×L scores and probabilities kept on the target as on this CPU")
    if not calls:
        return (f"{impl}: no attention call was seen in the trace, so nothing was modelled (a model that computes "
                "attention with its own ops is traced as it runs)")
    cpu = att.get("cpu_kernels") or {}
    if impl.startswith("flash_attention"):
        return (f"{impl}: modelled as the target runs it, {kernel}, for the {calls} attention calls of a micro "
                "batch's forward (the flash-attn package runs on CUDA GPUs only: the trace ran this model of it)")
    other = {k: n for k, n in cpu.items() if k != "flash"}
    instead = (f"; on this CPU dispatch would have run {', '.join(f'{k} ({n} calls)' for k, n in other.items())}"
               + (" -- L×L scores kept for backward, which the target does not keep" if "math" in other else "")
               if other else "; CPU dispatch would have run its flash kernel, which keeps the same tensors")
    return (f"{impl}: modelled as the target runs it, {kernel}, for the {calls} attention calls of a micro batch's "
            f"forward{instead}")


def _moments(st: dict, micro_batches: int) -> list[tuple[str, dict]]:
    """(phase, breakdown) of every moment the trace kept (trace.SCALES) that a device running ``micro_batches`` micro
    batches per update reaches: with one, never a later micro batch's (the earlier ones' gradients held). A trace
    written by hand without ``phases`` is one compute moment at its overall peak."""
    phases = st.get("phases") or {"compute": [{"bytes": st["peak_bytes"], "breakdown": st["breakdown"]}]}
    return [(name, m["breakdown"]) for name, moments in phases.items() for m in moments
            if micro_batches > 1 or name != "accumulating"]


def _parts(b: dict, activation_scale: float) -> StageBytes:
    return StageBytes(parameters=b.get("parameters", 0), gradients=b.get("gradients", 0),
                      optimizer=b.get("optimizer", 0), buffers=b.get("buffers", 0),
                      activations=b.get("activations", 0) * activation_scale,
                      weight_casts=b.get("weight_casts", 0))


def stage_memory(trace: dict, stage: str, acc: Accelerator, strategy: str, gpus: int,
                 micro_scale: float = 1.0, accumulating: bool | None = None) -> dict:
    """Per-rank peak of one stage. ``micro_scale`` rescales activations (another micro batch).

    Every moment the trace kept (forward/backward and optimizer step, see trace.SCALES) is placed on the
    target with its activations scaled, and the largest taken: a stage whose traced peak is the optimizer
    step (activation checkpointing) still grows with the batch from its backward moments -- saved layer
    inputs for every layer plus one layer's recompute and the logits -- never from the step's near-zero
    activations.
    """
    trace = compiled_trace(trace)   # a compiled job's activations (estimate/compiled.py); as traced otherwise
    st = trace["stages"][stage]
    training = stage in TRAINING_GATES
    chosen = placed_strategy(strategy, trace)   # with the job's distributed.offload where the strategy can
    # The train micro batch scales training activations only: evaluation keeps eval.batch_size.
    scale = micro_scale if training else 1.0
    # ``accumulating`` True: place the later micro batches' moments whatever the count (a hypothetical micro batch
    # that may still accumulate); None: as many micro batches as each device runs at this scale.
    per_device = 2 if accumulating else micro_batches_per_gpu(trace, chosen.compute_replicas(gpus), micro_scale)
    placed = [(name, chosen.estimate_memory(_parts(b, scale), trace, gpus, training))
              for name, b in _moments(st, per_device)]
    phase, (base, by_strategy) = max(placed, key=lambda p: p[1][0])
    corrections = [correction("allocator rounding (512 B blocks)", st["peak_bytes_rounded"] - st["peak_bytes"],
                              "allocated", f"{st.get('tensors', 0)} storages in the stage, each rounded up as the "
                              "caching allocator does")]
    corrections += by_strategy
    workspaces = acc.blas_workspace_bytes * (2 if training else 1)
    corrections.append(correction("library workspaces", workspaces, "allocated",
                                  f"{'hipBLASLt' if acc.stack == 'rocm' else 'cuBLAS'} workspace per handle: "
                                  f"{'forward and autograd threads' if training else 'one stream'}"))
    allocated = base + corrections[0]["bytes"] + workspaces
    margin = float(acc.defaults.get("reserved_margin", 0.10))
    reserved = allocated * (1 + margin)
    rocm = acc.stack == "rocm"
    # Sourced for CUDA (docs/catalog.md); on ROCm no measurement of these is known: the CUDA figures are used and the
    # row says so rather than reuse them silently (issue 42).
    unknown = " -- unknown for this stack (ROCm): no measurement is known, CUDA's figure is used" if rocm else ""
    corrections.append(correction("reserved-over-allocated margin", reserved - allocated, "reserved",
                                  f"{margin:.0%} for caching-allocator fragmentation (a GPU pilot measures the real "
                                  f"ratio){unknown}"))
    comm = acc.nccl_buffer_bytes if chosen.uses_collectives(gpus) else 0
    device_used = reserved + acc.context_bytes + comm
    corrections.append(correction("runtime context", acc.context_bytes, "device",
                                  f"{acc.stack.upper()} context with lazy module loading, outside the allocator"
                                  f"{unknown}"))
    if comm:
        corrections.append(correction("collective buffers", comm, "device",
                                      f"{'RCCL' if rocm else 'NCCL'} buffers for one communicator{unknown}"))
    return {"peak_allocated_bytes": int(allocated), "peak_reserved_bytes": int(reserved),
            "device_used_bytes": int(device_used), "corrections": corrections, "limiting_phase": phase,
            "workspace_bytes": workspaces,
            "unknown_for_stack": [c["name"] for c in corrections if unknown and c["reason"].endswith(unknown)]}


def micro_batches_per_gpu(trace: dict, replicas: int, micro_scale: float = 1.0) -> int:
    """The whole micro batches each of ``replicas`` devices runs in one update, at least one: the update's examples
    (the traced micro batch x the accumulation) at a micro batch ``micro_scale`` times the traced one."""
    return max(1, math.ceil(trace.get("grad_accum_steps", 1) / (replicas * micro_scale) - 1e-9))


def seconds_per_update(trace: dict, acc: Accelerator, strategy: str, gpus: int, precision: str,
                       utilisation: float | None = None, micro_scale: float = 1.0,
                       micro_batches: int | None = None, lengths: DataLengths | None = None) -> dict:
    """Seconds of one update on ``gpus`` of ``acc``: compute plus the communication it does not hide (the strategy's
    overlap model: FSDP2's prefetch hides most of it, the others none; ``communication_model`` says which).

    Compute is each traced op's larger of FLOPs and bytes (ops.roofline_seconds) at the accelerator's compute and
    bandwidth efficiencies: the micro batch's ops x the accumulation over the devices that split the update, plus
    the optimizer step over the devices that split it (all of them when it shards, else each runs all of it). Each
    device runs whole micro batches: at ``micro_scale`` (another micro batch, examples per update held) the traced
    micro batch's costs are scaled linearly and counted once per micro batch a device runs, at least one
    (``micro_batches`` gives that count where the caller arranged it, e.g. a sheet row). A ``utilisation`` measured
    by a pilot on this accelerator replaces the per-op model: each device's FLOPs over the dense peak x that share,
    scaled by FLOPs from the pilot's configuration to this one. A trace without per-op costs (written before them)
    takes the FLOPs at the catalog's default utilisation, and says so.

    ``lengths`` (lengths.data_lengths): each micro batch at the lengths the data gives it rather than at the traced
    (longest) one -- the roofline's ops re-timed at them, a measured utilisation scaled by the same ratio (the pilot
    timed its updates padded to the longest) -- and ``lengths`` in the answer says which; None: at the longest.

    ``fp8``: the converted Linears' matmuls at the FP8 peak with their casts as pilotrun's loop runs them, eagerly,
    or fused when ``train.compile`` compiles them (estimate/fp8.py; a trace fp8.fp8_trace already converted is taken
    as it is); its collectives carry bf16.
    """
    trace = compiled_trace(trace)   # a compiled job's fused element-wise ops (estimate/compiled.py)
    if precision == "fp8" and not trace.get("fp8_casts"):
        # A compiled loop fuses torchao's casts too (fp8.py's "fused"); pilotrun's eager loop runs them op by op.
        converted = fp8_trace(trace, "fused" if (trace.get("compiled") or {}).get("scope", "off") != "off"
                              else "eager")
        if converted is None:
            return {"seconds": None, "reason": why_none(trace)}
        trace = converted
    wire = "bf16" if precision == "fp8" else precision   # what FSDP gathers and reduces: bf16's bytes
    chosen = strategies.get(strategy)
    step = trace["stages"][GateName.STEADY_STEP]
    flops = step["flops"]
    peak = acc.peak_flops(precision)
    per_device = micro_batches or micro_batches_per_gpu(trace, chosen.compute_replicas(gpus), micro_scale)
    share = per_device * micro_scale   # traced micro batches' worth of work on each device
    bw, link = collective_bandwidth(acc, gpus)
    comm = chosen.communication_seconds(trace, gpus, wire, bw, per_device)
    at = _at_lengths(trace, step, acc, chosen, gpus, micro_scale, lengths)
    # The FLOPs one device runs: the traced micro batch's (the update's / the accumulation) x its share, at the
    # data's lengths.
    device_flops = flops / max(1, trace.get("grad_accum_steps", 1)) * share * at.flops_factor
    if utilisation is None and step.get("ops"):
        def expose(compute_seconds: float) -> tuple[float, str]:
            return chosen.exposed_communication(comm, trace, gpus, wire, bw, per_device, compute_seconds)

        return {**_roofline(step, acc, chosen, gpus, peak, (comm, expose), per_device, share, device_flops, at),
                "communication": link, "lengths": at.view}
    util = utilisation if utilisation is not None else float(acc.defaults.get("utilisation", 0.4))
    if not peak:
        return {"seconds": None, "reason": f"{acc.name} has no {precision} peak in the catalog", "lengths": at.view}
    # A measured utilisation is the pilot's update at the longest length, scaled as the per-op model scales it.
    compute = device_flops / at.flops_factor * at.time_factor / (peak * util)
    exposed, how = chosen.exposed_communication(comm, trace, gpus, wire, bw, per_device, compute)
    return {"seconds": compute + exposed, "compute_seconds": compute, "communication_seconds": comm,
            "exposed_communication_seconds": exposed, "communication": link, "micro_batches_per_gpu": per_device,
            "communication_model": how, "model": "flops",
            "flops_per_update": flops, "peak_flops": peak, "utilisation": util,
            "bound": "compute" if compute >= exposed else "communication", "lengths": at.view}


def _at_lengths(trace: dict, step: dict, acc: Accelerator, chosen, gpus: int, micro_scale: float,
                lengths: DataLengths | None) -> AtLengths:
    """A micro batch at ``lengths`` (lengths.expected_micro): each rank's micro batch of the traced examples x
    ``micro_scale``, the ranks that run it in step (those whose collectives meet every micro batch) waiting for the
    longest. At the longest when ``lengths`` is None."""
    if lengths is None:
        return AtLengths({})   # not asked (the advisor's ratios, the benches): at the longest, no row to say it
    ranks = chosen.compute_replicas(gpus) if chosen.uses_collectives(gpus) else 1
    return expected_micro(trace, step, acc, acc.efficiencies(), lengths,
                          max(1.0, (step.get("batch_size") or 1) * micro_scale), (ranks, bool(chosen.shards)))


def collective_bandwidth(acc: Accelerator, gpus: int) -> tuple[float, dict]:
    """Bytes per second per GPU for the collectives of ``gpus`` devices, and which link that is: ``{"link",
    "lower_bound"}``. Beyond one node (``interconnect.gpus_per_node``) the ring runs at the slower link between nodes
    (``inter_node_gb_s``); without that figure the intra-node one is used and the time is a lower bound."""
    per_node = int(acc.interconnect.get("gpus_per_node") or 8)
    intra = float(acc.interconnect.get("per_gpu_gb_s", 0)) * 1e9
    if gpus <= per_node:
        return intra, {"link": f"within one node at {intra / 1e9:g} GB/s per GPU", "lower_bound": False}
    nodes = math.ceil(gpus / per_node)
    inter = acc.interconnect.get("inter_node_gb_s")
    if inter:
        return float(inter) * 1e9, {"link": f"across {nodes} nodes at {float(inter):g} GB/s per GPU",
                                    "lower_bound": False}
    return intra, {"link": f"across {nodes} nodes at the intra-node {intra / 1e9:g} GB/s per GPU: the catalog has no "
                           f"interconnect.inter_node_gb_s for {acc.name}, so the time is a lower bound (add it in a "
                           "--catalog file, e.g. 50 for 400 Gb/s per GPU)", "lower_bound": True}


def _roofline(step: dict, acc: Accelerator, chosen, gpus: int, peak: float | None, wire: tuple, per_device: int,
              share: float, device_flops: float, at: AtLengths) -> dict:
    """The per-op time model; ``wire`` is (the update's communication seconds, the function that says how much of
    them a given compute hides); ``at`` the micro batch at the data's lengths (its seconds None: as traced)."""
    comm, expose = wire
    eff = acc.efficiencies()
    micro = roofline_seconds(step["ops"], acc, eff.compute, eff.bandwidth)
    opt = roofline_seconds(step.get("optimizer_ops") or [], acc, eff.compute, eff.bandwidth)
    if micro["seconds"] is None or opt["seconds"] is None:
        return {"seconds": None, "reason": micro.get("reason") or opt.get("reason")}
    if at.seconds is not None:
        micro = {**micro, "seconds": at.seconds, "memory_bound_seconds": at.memory_bound_seconds}
    step_replicas = chosen.optimizer_replicas(gpus)
    opt_s = opt["seconds"] / step_replicas
    exposed, how = expose(micro["seconds"] * share)
    compute = micro["seconds"] * share + opt_s
    memory_bound = micro["memory_bound_seconds"] * share + opt["memory_bound_seconds"] / step_replicas
    flops = step["flops"]
    compute_bound = compute - memory_bound
    bound = ("communication" if exposed >= compute else "memory" if memory_bound >= compute_bound else "compute")
    return {"seconds": compute + exposed, "compute_seconds": compute, "communication_seconds": comm,
            "exposed_communication_seconds": exposed, "communication_model": how, "model": "roofline",
            "memory_bound_seconds": memory_bound, "optimizer_seconds": opt_s, "micro_batches_per_gpu": per_device,
            "bytes_per_update": micro["bytes"] * share + opt["bytes"] / step_replicas,
            "flops_per_update": flops, "peak_flops": peak,
            # The share of the dense peak the whole update reaches (MFU-like, recompute included): what a pilot's
            # measured utilisation is compared with.
            "utilisation": (device_flops / (compute * peak)) if (peak and compute) else None,
            "compute_efficiency": eff.compute, "bandwidth_efficiency": eff.bandwidth,
            "efficiency_source": eff.source, "bound": bound}


def time_source(t: dict, measured: str | None = None) -> str:
    """How a row's time was reached, for a person: the pilot that measured it, or the model and its figures."""
    link = t.get("communication") or {}
    lower = f"; communication {link['link']}" if link.get("lower_bound") else ""
    lower += f"; {t['offload']['model']}" if t.get("offload") else ""
    lower += f"; {t['lengths']['note']}" if (t.get("lengths") or {}).get("note") else ""
    if t.get("unaligned_matmuls"):
        u = t["unaligned_matmuls"]
        lower += (f"; a lower bound: {u['flops_share']:.0%} of the FLOPs in matmuls off the tensor cores' alignment "
                  f"({', '.join(u['modules'][:SHOWN_MODULES])}; pad {short(u['dimensions'])}), slower by an amount "
                  "not modelled")
    if measured:
        return f"{measured}; scaled by FLOPs from the pilot's configuration to this one{lower}"
    if t.get("model") == "roofline":
        share = t["memory_bound_seconds"] / t["seconds"] if t.get("seconds") else 0
        return (f"each op at {t['compute_efficiency']:.0%} of its dtype's peak or {t['bandwidth_efficiency']:.0%} of "
                f"the memory bandwidth, whichever is slower ({share:.0%} of the update memory-bound); "
                f"{t['efficiency_source']}{lower}")
    if t.get("utilisation") is not None:
        return f"{t['utilisation']:.0%} of the dense peak (catalog default; the trace has no per-op costs){lower}"
    return t.get("reason") or "no time estimate"


def estimate_fit(trace: dict, acc: Accelerator, strategy: str, gpus: int, precision: str | None = None,
                 utilisation: float | None = None, micro_scale: float = 1.0, micro_batches: int | None = None,
                 accumulating: bool | None = None, lengths: DataLengths | None = None,
                 offload: str | None = None) -> dict:
    """One row of the ``fits`` table: the largest stage's per-rank peaks against capacity (at the longest batch,
    always), and time (at the data's ``lengths`` when given, see seconds_per_update; ``time_lengths`` says which).
    ``offload`` (distributed.offload; None: the trace's, the spec's): the state kept on the host where the strategy
    can (offload.py: the device's bytes drop, ``host_memory`` and the host's time are added)."""
    if not strategies.get(strategy).multi_process and gpus != 1:
        raise ValueError(f"strategy {strategy} uses one GPU")
    if offload is not None:
        trace = {**trace, "offload": offload}
    precision = precision or trace["precision"]
    trace = compiled_trace(trace)
    stages = {s: stage_memory(trace, s, acc, strategy, gpus, micro_scale, accumulating) for s in STAGES}
    worst = max(STAGES, key=lambda s: stages[s]["device_used_bytes"])
    t = seconds_per_update(trace, acc, strategy, gpus, precision, utilisation, micro_scale, micro_batches, lengths)
    placed = placed_strategy(strategy, trace)
    t = offload_time(t, trace, acc, placed, gpus, precision, collective_bandwidth(acc, gpus)[0])
    # Said on the per-op model's time only: a pilot's measured utilisation already ran the slow kernels, and a row
    # without a time (offload without a host link) has nothing to call a lower bound.
    unaligned = unaligned_view(trace["stages"][GateName.STEADY_STEP]) if (
        t.get("model") == "roofline" and t.get("seconds") is not None) else None
    if unaligned:
        t["unaligned_matmuls"] = unaligned
    host = host_memory(trace, acc, placed, gpus)
    return {
        "accelerator": acc.name, "strategy": strategy, "gpus": gpus, "precision": precision,
        "peak_allocated_bytes": stages[worst]["peak_allocated_bytes"],
        "peak_reserved_bytes": stages[worst]["peak_reserved_bytes"],
        "device_used_bytes": stages[worst]["device_used_bytes"],
        "capacity_bytes": acc.memory_bytes,
        # With offload the node's host memory must hold the state too, where the catalog knows it.
        "fits": stages[worst]["device_used_bytes"] <= acc.memory_bytes and (host is None or host["fits"] is not False),
        "limiting_stage": worst,
        "offload": placed.offload, "host_memory": host, "host_bytes_per_node": host["bytes_per_node"] if host else 0,
        "seconds_per_update": t.get("seconds"),
        "time": t,
        "time_lengths": t.get("lengths") or None,
        "stages": stages,
        "notes": _kernel_notes(trace) + offload_notes(trace, placed) + (
            [correction("host memory (CPU offload)", host["bytes_per_node"], "host", host["note"])] if host else []),
        # Corrections whose figure is CUDA's because none is known for this accelerator's stack (ROCm)
        "unknown_for_stack": stages[worst]["unknown_for_stack"],
    }


def largest_scale_that_fits(trace: dict, acc: Accelerator, strategy: str, gpus: int, headroom: float) -> float:
    """How far activations may grow (micro batch or length, at linear scaling) while the worst stage fits. The
    micro batch found may still be accumulated: an earlier micro batch's gradients stay in its moments."""
    budget = acc.memory_bytes * (1 - headroom)

    def fits(scale: float) -> bool:
        return estimate_fit(trace, acc, strategy, gpus, micro_scale=scale, accumulating=True)[
            "device_used_bytes"] <= budget

    lo, hi = 0.0, 1.0
    while fits(hi) and hi < 1024:
        lo, hi = hi, hi * 2
    if hi == 1.0 and not fits(1e-6):
        return 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo if not math.isinf(lo) else 0.0
