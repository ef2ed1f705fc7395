"""FSDP2: ``fully_shard`` on every repeated block and the root; parameters, gradients and optimizer state sharded,
and with ``distributed.offload: cpu`` kept in host memory (FSDP2's ``CPUOffloadPolicy``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..humanize import human_bytes
from ..models.structure import repeated_blocks
from ..train.batches import HALF_DTYPES, half_name
from .base import BufferSync, DistributedCheckpoint, StageBytes, correction, probe_reduction, reduction_probe


class FSDP(DistributedCheckpoint):
    name = "fsdp"
    description = "FSDP2 fully_shard of each repeated block and the root"
    shards = True
    offloads = True

    def wrap(self, model, env, device):
        from torch.distributed.fsdp import fully_shard

        policy, mesh, said = self._offload_policy(device)
        mixed, mixed_said = self._mixed_precision()
        _, blocks = repeated_blocks(model)
        for block in blocks:
            fully_shard(block, mesh=mesh, offload_policy=policy, mp_policy=mixed)
        fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=mixed)
        return model, (f"FSDP2 over {env.world_size} processes ({dist.get_backend()}): {len(blocks)} blocks and the "
                       f"root sharded{mixed_said}{said}")

    def gathered_dtype(self) -> torch.dtype | None:
        low = gather_dtype(self.precision)
        return None if low is None else HALF_DTYPES[low]

    def _mixed_precision(self):
        """(FSDP2's MixedPrecisionPolicy for ``train.precision``, what the wrap sentence adds).

        fp32 master weights trained in a 2-byte dtype (bf16, fp16, fp8's bf16) are gathered in that dtype and their
        gradients reduced in fp32, as torchtitan runs FSDP2 and as the estimate counts it (:func:`gather_dtype`):
        without it every block would be gathered in fp32 and autocast would copy each weight again."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtype = self.gathered_dtype()
        if dtype is None:
            return MixedPrecisionPolicy(), ""
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32), (
            f"; parameters gathered in {half_name(dtype)}, gradients reduced in fp32 "
            "(MixedPrecisionPolicy)")

    def _offload_policy(self, device: torch.device):
        """(FSDP2's offload policy, the mesh to shard over (None: the default one), what the wrap sentence adds)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if self.offload == "none":
            return OffloadPolicy(), None, ""
        if device.type == "cpu":
            # pin_memory() needs an accelerator (a CPU-only torch raises "Cannot access accelerator device"); on a CPU
            # device the shards are host memory already and FSDP2's copies to and from the device change nothing.
            return CPUOffloadPolicy(pin_memory=False), None, (
                "; CPU offload (on a CPU device the state is in host memory already: nothing moves, nothing pinned)")
        return CPUOffloadPolicy(pin_memory=True), _host_collective_mesh(device), (
            "; CPU offload: parameters, gradients and optimizer state in host memory (parameters and gradients "
            "pinned), the optimizer step on the CPU")

    def buffer_sync(self, model):
        # fully_shard shards parameters only: buffers stay plain per-rank tensors that nothing synchronises.
        return BufferSync(None, "FSDP2 neither shards nor synchronises buffers: each rank keeps its own copy and the "
                                "checkpoint holds one copy for all ranks; if the copies differ (BatchNorm running "
                                "statistics), convert the model with torch.nn.SyncBatchNorm.convert_sync_batchnorm "
                                "(GPU only)")

    def reduction_ratio(self, env, device):
        from torch.distributed.fsdp import fully_shard

        probe = reduction_probe(device)
        holder = torch.nn.Sequential(probe)
        fully_shard(holder)
        return probe_reduction(holder, probe, device)

    def estimate_memory(self, stage: StageBytes, trace: dict, gpus: int, training: bool):
        # FSDP on one GPU is still FSDP: nothing is split, but the blocks are gathered into their own buffers (in the
        # compute dtype) and the autocast copies are not made.
        sharded = stage.state / gpus
        # FSDP2's MixedPrecisionPolicy(param_dtype=bf16/fp16) gathers parameters in the compute dtype:
        # no separate autocast copies, and the gathered layer is half the size of fp32. FP8 training gathers in bf16
        # too (torchtitan's param_dtype under float8; a float8 all-gather would halve it again: an upper bound), as the
        # communication already counts it (model.seconds_per_update's wire).
        low = _low(trace["precision"])
        size = _Sizes.of(trace, trace["precision"])
        inflight = size.root_gathered + 2 * size.gathered + (size.grad if training else 0)
        frozen = training and size.grad < size.stored
        corrections = [
            correction("FSDP2 sharding", sharded - stage.state, "allocated",
                       f"parameters, gradients and optimizer state split over {gpus} ranks" if gpus > 1 else
                       "one rank: nothing split"),
            correction("FSDP2 unsharded layer in flight", inflight, "allocated",
                       f"the root's own parameters stay gathered; {trace['largest_layer']} gathered for compute and "
                       f"the next one prefetched{' in ' + trace['precision'] if low else ''}"
                       f"{', a quantised base packed as stored' if size.packed else ''}"
                       f"{', plus its unsharded gradient before reduce-scatter' if training else ''}"
                       f"{' (its trainable parameters only: frozen weights have none)' if frozen else ''}"),
        ]
        if stage.weight_casts:
            corrections.append(correction("FSDP2 mixed precision instead of autocast copies", -stage.weight_casts,
                                          "allocated", "MixedPrecisionPolicy gathers parameters in the compute "
                                          "dtype, so the autocast copies of every weight kept for backward are not "
                                          "made"))
        resident = sharded
        if self.offload != "none":
            # CPUOffloadPolicy: the shards live on the host. On the device: the shard of the layer being gathered,
            # copied in (in its stored dtype) before its all-gather, and in training one gradient shard out of the
            # reduce-scatter before its copy to the host (FSDP2 _fsdp_param.all_gather_inputs, foreach_reduce).
            resident = (size.stored + (size.grad if training else 0)) / gpus
            corrections.append(correction(
                "FSDP2 CPU offload", resident - sharded, "allocated",
                f"parameters, gradients and optimizer state ({human_bytes(sharded)} per rank) kept in host memory "
                f"(distributed.offload: cpu); on the device only {trace['largest_layer']}'s parameter shard copied in "
                f"before its all-gather{' and one gradient shard before its copy to the host' if training else ''}"))
        replicated = quant_state_bytes(trace)
        if replicated and (gpus > 1 or self.offload != "none"):
            # bitsandbytes keeps a quantised weight's absmax and codes as attributes of its Params4bit (its SCB on
            # Int8Params), not as parameters: FSDP flattens and shards, or offloads, only the packed weight; every rank
            # holds the whole state on its device (bitsandbytes issue 1945: quant_state left beside the shard, a
            # buffer replicated).
            kept = replicated if self.offload != "none" else replicated - replicated / gpus
            corrections.append(correction(
                "quantisation state on every rank", kept, "allocated",
                f"bitsandbytes' absmax and codes of the quantised weights ({human_bytes(replicated)}) are not "
                f"parameters: FSDP neither shards {'nor offloads ' if self.offload != 'none' else ''}them"))
            resident += kept
        return resident + stage.buffers + stage.activations + inflight, corrections

    def host_bytes(self, trace, gpus):
        """With offload: each rank's shard of the parameters and gradients (pinned) and of the optimizer state (the
        optimizer's own host tensors), as stored; the CPU step's temporaries are not counted (the fused kernel has
        none, the per-parameter path one tensor's at a time)."""
        if self.offload == "none":
            return 0.0
        return (trace["parameter_bytes"] - quant_state_bytes(trace) + trace["gradient_bytes"]
                + trace["optimizer_state_bytes"]) / gpus

    def communication_seconds(self, trace, gpus, precision, bytes_per_second, micro_batches=1):
        if gpus < 2 or not bytes_per_second:
            return 0.0
        # Parameters gathered (in the compute dtype) for forward and again for backward, fp32 gradients
        # reduce-scattered, on every micro batch this rank runs.
        micro_steps = max(1, micro_batches)
        compute_bytes = _Sizes.of(trace, precision).total_gathered
        return micro_steps * (2 * compute_bytes + trace["gradient_bytes"]) * (gpus - 1) / gpus / bytes_per_second

    def exposed_communication(self, total, trace, gpus, precision, bytes_per_second, micro_batches, compute_seconds):
        """FSDP2 prefetches: the next block's all-gather runs while this block computes, and a block's reduce-scatter
        while the block before it runs its backward. Per micro batch the update waits for the root's and the first
        block's all-gather in forward, the first block's in backward and the last reduce-scatters (nothing computes
        beside them), and for each other block only what its communication takes beyond its compute. The compute
        of a micro batch is split 1 : 2 between forward and backward (a matmul's backward is two matmuls) and evenly
        over the blocks."""
        if not total:
            return 0.0, "no communication"
        micro = max(1, micro_batches)
        chain = _Chain.of(trace, gpus, precision, bytes_per_second, 0.0)
        exposed = min(total, micro * chain.exposed(compute_seconds / micro))
        return exposed, (f"overlapped as FSDP2 prefetches: {exposed / total:.0%} of the communication exposed (the "
                         "root's and the first block's gathers, the last reduce-scatters, and what any block's "
                         "communication takes beyond its compute)")

    def offload_seconds(self, trace, gpus, precision, wire, micro_batches, compute_seconds):
        """With offload, per micro batch: each block's parameter shard copied host to device before its all-gather in
        forward and again in backward (resharded after forward), the root's once (it stays gathered), and every
        gradient shard device to host after its reduce-scatter, at the host link's bytes per second per direction.
        FSDP2 issues the copy-in on its all-gather copy-in stream (non-blocking, from pinned memory), so a block's
        copy runs before its gather and overlaps compute as the gather does; the gradient copy is non-blocking on the
        first micro batch of an update and synchronous on later ones (FSDP2 adds into the host gradient), so those
        are exposed in full. The exposed part is what the chain with the copies exposes beyond the chain without."""
        if self.offload == "none":
            return super().offload_seconds(trace, gpus, precision, wire, micro_batches, compute_seconds)
        collective, host = wire
        micro = max(1, micro_batches)
        plain = _Chain.of(trace, gpus, precision, collective, 0.0)
        copied = _Chain.of(trace, gpus, precision, collective, host)
        per_micro = compute_seconds / micro
        blocks = plain.blocks
        total = micro * (2 * blocks * copied.h2d + copied.root_h2d + blocks * copied.d2h + copied.root_d2h)
        first = copied.exposed(per_micro) - plain.exposed(per_micro)
        synchronous = blocks * copied.d2h + copied.root_d2h
        later = copied.without_d2h().exposed(per_micro) - plain.exposed(per_micro) + synchronous
        exposed = min(total, max(0.0, first + (micro - 1) * later))
        return {"pcie_seconds": total, "exposed_pcie_seconds": exposed,
                "model": (f"host link {host / 1e9:g} GB/s per direction per GPU: parameter shards copied in before "
                          "each all-gather (FSDP2's copy-in stream: overlapped with compute as the gathers are), "
                          "gradient shards copied out after each reduce-scatter (overlapped on an update's first "
                          f"micro batch, synchronous on later ones); {exposed / total:.0%} of {total:.3g} s exposed"
                          if total else "nothing to copy")}


class _Chain:
    """One micro batch's FSDP2 communication per block as seconds: all-gather and reduce-scatter over the
    collective link, plus (with offload) the host copies serialised before each gather and after each scatter."""

    def __init__(self, blocks: int, gather: float, scatter: float, root_gather: float, root_scatter: float,
                 h2d: float = 0.0, d2h: float = 0.0, root_h2d: float = 0.0, root_d2h: float = 0.0) -> None:
        self.blocks, self.gather, self.scatter = blocks, gather, scatter
        self.root_gather, self.root_scatter = root_gather, root_scatter
        self.h2d, self.d2h, self.root_h2d, self.root_d2h = h2d, d2h, root_h2d, root_d2h

    @classmethod
    def of(cls, trace: dict, gpus: int, precision: str, collective: float, host: float) -> _Chain:
        """``collective``, ``host``: bytes per second (0: that link is not used)."""
        z = _Sizes.of(trace, precision)
        wire = (gpus - 1) / gpus / collective if gpus > 1 and collective else 0.0
        # A shard crosses the host link in its stored dtype: FSDP2 casts to the compute dtype on the device.
        copy = 1 / gpus / host if host else 0.0
        return cls(z.blocks, z.gathered * wire, z.grad * wire, z.root_gathered * wire, z.root_grad * wire,
                   z.stored * copy, z.grad * copy, z.root_stored * copy, z.root_grad * copy)

    def without_d2h(self) -> _Chain:
        return _Chain(self.blocks, self.gather, self.scatter, self.root_gather, self.root_scatter, self.h2d, 0.0,
                      self.root_h2d, 0.0)

    def exposed(self, compute_seconds: float) -> float:
        """Seconds one micro batch waits: the root's and the first block's gathers in forward, the first block's in
        backward and the last reduce-scatters (nothing computes beside them), and for each other block what its
        communication takes beyond its compute; a micro batch's compute split 1 : 2 between forward and backward (a
        matmul's backward is two matmuls) and evenly over the blocks."""
        per_block = compute_seconds / self.blocks
        gather, scatter = self.gather + self.h2d, self.scatter + self.d2h
        forward = self.root_gather + self.root_h2d + gather + (self.blocks - 1) * max(0.0, gather - per_block / 3)
        backward = (gather + (self.blocks - 1) * max(0.0, gather + scatter - 2 * per_block / 3) + scatter
                    + self.root_scatter + self.root_d2h)
        return forward + backward


def _host_collective_mesh(device: torch.device):
    """A mesh over every rank whose process group also runs collectives on host tensors, or None when the default
    group already does. With offload the gradients and the state are host tensors: clipping's global norm
    (``DTensor.full_tensor``) and the gathered state dict reduce them on the host, which NCCL/RCCL alone cannot;
    torchtitan initialises ``cuda:nccl,cpu:gloo`` when it offloads (distributed/utils.py init_distributed)."""
    from torch.distributed.device_mesh import DeviceMesh

    if "cpu:" in str(dist.get_backend_config()):
        return None
    group = dist.new_group(backend=f"{device.type}:{dist.get_backend()},cpu:gloo")
    return DeviceMesh.from_group(group, device.type)


def quant_state_bytes(trace: dict) -> int:
    """The quantisation state of a quantised base (estimate/adapted.Adaptation.quant_state_bytes), 0 without one or
    in a trace written before it was counted apart."""
    return int((trace.get("adaptation") or {}).get("quant_state_bytes") or 0)


def gather_dtype(precision: str) -> str | None:
    """The 2-byte dtype FSDP2 gathers fp32 master weights in under ``train.precision`` (MixedPrecisionPolicy's
    param_dtype, which :meth:`FSDP.wrap` sets: the autocast dtype; fp8 training keeps bf16's); None where the
    weights are gathered as stored (fp32, or bf16 weights already)."""
    from ..config.sections import AUTOCAST_DTYPE, BF16_WEIGHTS

    return None if precision in BF16_WEIGHTS else AUTOCAST_DTYPE.get(precision)


def _low(precision: str) -> bool:
    """Whether FSDP2 gathers float parameters in a 2-byte compute dtype."""
    return gather_dtype(precision) is not None


@dataclass(frozen=True)
class _Sizes:
    """The largest block's and the root's bytes as FSDP2 moves them (the trace's ``fsdp_parts``): float parameters
    stored in fp32 are gathered in the compute dtype under a 2-byte policy; everything else as stored (bf16 floats, a
    quantised base's packed weights, which are not floats to cast); a quantised base's state (bitsandbytes' absmax and
    codes: attributes, not parameters) not at all, every rank keeping it whole ("quantisation state on every rank").
    A block's unsharded gradient holds its trainable parameters only: frozen weights (a LoRA or QLoRA base) have
    none."""

    blocks: int
    stored: float          # a block's parameters as stored, its quantisation state excluded
    gathered: float        # a block as gathered for compute
    grad: float            # a block's unsharded gradient
    root_stored: float     # the root's own parameters (embeddings, head, final norm)
    root_gathered: float
    root_grad: float
    packed: bool           # a quantised base's packed weights among the block's
    total_gathered: float  # every parameter as gathered

    @classmethod
    def of(cls, trace: dict, precision: str) -> _Sizes:
        blocks = max(int(trace.get("layers", 0) or 0), 1)
        scale = 0.5 if _low(precision) else 1.0
        parts = trace.get("fsdp_parts") or _uniform_parts(trace)
        block, root, model = parts["block"], parts["root"], parts["model"]

        def gathered(p: dict) -> float:
            return p["fp32"] * scale + p["stored"]

        return cls(blocks, block["fp32"] + block["stored"], gathered(block), block["trainable"],
                   root["fp32"] + root["stored"], gathered(root), root["trainable"],
                   bool((trace.get("adaptation") or {}).get("quantized_bytes")), gathered(model))


def _uniform_parts(trace: dict) -> dict:
    """``fsdp_parts`` of a trace written by hand (tests' synthetic traces; every cached trace carries its own): every
    parameter a float in fp32 unless the weights are bf16 (bf16-true), the blocks holding all but the root's, each
    block's trainable bytes its share of the model's."""
    layer, params = trace["largest_layer_bytes"], max(trace["parameter_bytes"], 1)
    kind = "stored" if trace["precision"].startswith("bf16-true") else "fp32"
    share = trace["gradient_bytes"] / params
    root = max(0, params - layer * max(int(trace.get("layers", 0) or 0), 1))

    def part(n: float) -> dict:
        return {"fp32": 0, "stored": 0, "state": 0, kind: n, "trainable": n * share}

    return {"block": part(layer), "root": part(root), "model": part(params)}
