"""CPU offload in the estimate (``distributed.offload: cpu``, FSDP2's ``CPUOffloadPolicy``): pure functions.

With offload each rank's shard of the parameters, gradients and optimizer state lives in host memory, so the device
keeps only what is in flight (``Strategy.estimate_memory``: the gathered layers, activations, one shard being copied)
and the host holds the rest. What that costs and needs, each with what it assumed:

* host memory per node -- each rank's shard (``Strategy.host_bytes``) x the ranks on one node, checked against the
  node's memory where the catalog knows it (``host.memory_gb``; a rental's figure, unknown built in);
* the copies over the host link -- parameter shards in before each all-gather, gradient shards out after each
  reduce-scatter, at the GPU's host link per direction (``host.link_gb_s``, datasheet) or less where the node's
  memory bandwidth shared by its ranks is lower; overlapped as ``Strategy.offload_seconds`` says;
* the optimizer step on the CPU instead of the GPU -- memory-bound: each trainable parameter, its gradient and its
  optimizer state read, the parameter and the state written (AdamW in fp32: 28 bytes per element), by every rank of
  a node at once through the node's memory bandwidth (``host.memory_bandwidth_gb_s``); without that figure the step
  is unknown and the time a lower bound, and the row says so. Nothing overlaps it: the GPUs wait for the step.

Example::

    chosen = placed_strategy("fsdp", {**trace, "offload": "cpu"})
    host_memory(trace, acc, chosen, 8)["bytes_per_node"]
"""
from __future__ import annotations

from .. import strategies
from ..humanize import human_bytes
from ..strategies import Strategy, correction
from .catalog import Accelerator


def placed_strategy(strategy: str, trace: dict) -> Strategy:
    """The strategy as the job runs it: with the job's ``offload`` (the trace carries the spec's, ``runner.Traces``)
    where the strategy can offload; a strategy that cannot is estimated as it is (:func:`offload_notes` says so)."""
    chosen = strategies.get(strategy)
    offload = trace.get("offload") or "none"
    return chosen.configured(offload) if chosen.offloads else chosen


def offload_notes(trace: dict, chosen: Strategy) -> list[dict]:
    """The row's line when the job asks for offload and this row's strategy cannot do it."""
    asked = trace.get("offload") or "none"
    if asked == "none" or chosen.offload != "none":
        return []
    return [correction("CPU offload", 0, "allocated",
                       f"distributed.offload: {asked} not applied to this row: {chosen.name} keeps its state on the "
                       "device (only a strategy that shards can offload)")]


def ranks_per_node(acc: Accelerator, gpus: int) -> int:
    return max(1, min(gpus, int(acc.interconnect.get("gpus_per_node") or 8)))


def host_memory(trace: dict, acc: Accelerator, chosen: Strategy, gpus: int) -> dict | None:
    """Host memory the training state takes on one node, against the node's where the catalog knows it; None when the
    strategy keeps nothing on the host."""
    per_rank = chosen.host_bytes(trace, gpus)
    if not per_rank:
        return None
    ranks = ranks_per_node(acc, gpus)
    per_node = per_rank * ranks
    capacity_gb = acc.host_figure("memory_gb")
    capacity = int(capacity_gb * 1e9) if capacity_gb else None
    fits = None if capacity is None else per_node <= capacity
    against = ("host memory of the node unknown (give host.memory_gb, in GB, in a --catalog file)" if capacity is None
               else f"{'within' if fits else 'more than'} the node's {human_bytes(capacity)} (host.memory_gb)")
    return {"bytes_per_rank": int(per_rank), "ranks_per_node": ranks, "bytes_per_node": int(per_node),
            "capacity_bytes": capacity, "fits": fits,
            "note": (f"{human_bytes(per_node)} of host memory per node: {ranks} ranks x {human_bytes(per_rank)} (each "
                     "rank's shard of the parameters and gradients, pinned, and of the optimizer state); "
                     f"{against}")}


def cpu_step_bytes(trace: dict) -> float:
    """Bytes the whole optimizer step reads and writes in host memory: each trainable parameter (as large as its
    gradient), its gradient and its state read, the parameter and the state written."""
    grads, state = trace["gradient_bytes"], trace["optimizer_state_bytes"]
    return 3 * grads + 2 * state


def offload_time(t: dict, trace: dict, acc: Accelerator, chosen: Strategy, gpus: int, precision: str,
                 collective_bytes_per_second: float) -> dict:
    """``t`` (model.seconds_per_update) with offload: the GPU's own optimizer step removed, the host copies it does
    not hide and the CPU step added, and ``offload`` saying each figure and what it assumed. Unchanged without
    offload or without a time; no time where the catalog lacks the host link."""
    if chosen.offload == "none" or t.get("seconds") is None:
        return t
    link = acc.host_figure("link_gb_s")
    if not link:
        return {**t, "seconds": None,
                "reason": (f"{acc.name} has no host.link_gb_s in the catalog: CPU offload's copies between host and "
                           "device cannot be timed (give it, GB/s per direction, in a --catalog file)")}
    ranks = ranks_per_node(acc, gpus)
    node_bw = acc.host_figure("memory_bandwidth_gb_s")
    host_bps = min(link * 1e9, node_bw * 1e9 / ranks) if node_bw else link * 1e9
    gpu_step = float(t.get("optimizer_seconds") or 0.0)
    compute = t["compute_seconds"] - gpu_step
    per_device = int(t.get("micro_batches_per_gpu") or 1)
    pcie = chosen.offload_seconds(trace, gpus, precision, (collective_bytes_per_second, host_bps), per_device,
                                  compute)
    node_bytes = cpu_step_bytes(trace) / chosen.optimizer_replicas(gpus) * ranks
    cpu_step = node_bytes / (node_bw * 1e9) if node_bw else None
    step_said = (f"{node_bytes / 1e9:.3g} GB read and written on the node ({ranks} ranks' shards) at "
                 f"host.memory_bandwidth_gb_s {node_bw:g}: {cpu_step:.3g} s, memory-bound (a lower bound where the "
                 "host's cores are slower than its memory)" if cpu_step is not None else
                 "unknown: the catalog has no host.memory_bandwidth_gb_s for the node (give it in a --catalog file), "
                 "so the time is a lower bound")
    host = pcie["exposed_pcie_seconds"] + (cpu_step or 0.0)
    seconds = compute + t.get("exposed_communication_seconds", 0.0) + host
    return {**t, "seconds": seconds, "compute_seconds": compute,
            "bound": "host" if host >= compute else t.get("bound"),
            "offload": {"pcie_seconds": pcie["pcie_seconds"], "exposed_pcie_seconds": pcie["exposed_pcie_seconds"],
                        "cpu_step_seconds": cpu_step, "gpu_step_seconds_removed": gpu_step,
                        "host_link_gb_s": host_bps / 1e9, "lower_bound": cpu_step is None,
                        "model": (f"CPU offload: {pcie['model']}; the optimizer step on the CPU, not overlapped "
                                  f"(the GPUs wait): {step_said}; the GPU's own step ({gpu_step:.3g} s) not run; "
                                  "the host adds of later micro batches' gradients not counted")}}
