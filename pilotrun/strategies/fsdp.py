"""FSDP2: ``fully_shard`` on every repeated block and the root; parameters, gradients and optimizer state sharded."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.structure import repeated_blocks
from .base import BufferSync, DistributedCheckpoint, StageBytes, correction, probe_reduction, reduction_probe


class FSDP(DistributedCheckpoint):
    name = "fsdp"
    description = "FSDP2 fully_shard of each repeated block and the root"
    shards = True

    def wrap(self, model, env, device):
        from torch.distributed.fsdp import fully_shard

        _, blocks = repeated_blocks(model)
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        return model, (f"FSDP2 over {env.world_size} processes ({dist.get_backend()}): {len(blocks)} blocks and the "
                       "root sharded")

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
        # no separate autocast copies, and the gathered layer is half the size of fp32.
        low = trace["precision"] in ("bf16", "fp16")
        scale = 0.5 if low else 1.0
        layer = trace["largest_layer_bytes"]
        root = max(0, trace["parameter_bytes"] - layer * max(trace.get("layers", 0), 1))
        inflight = (root + 2 * layer) * scale + (layer if training else 0)
        corrections = [
            correction("FSDP2 sharding", sharded - stage.state, "allocated",
                       f"parameters, gradients and optimizer state split over {gpus} ranks" if gpus > 1 else
                       "one rank: nothing split"),
            correction("FSDP2 unsharded layer in flight", inflight, "allocated",
                       f"the root's own parameters stay gathered; {trace['largest_layer']} gathered for compute and "
                       f"the next one prefetched{' in ' + trace['precision'] if low else ''}"
                       f"{', plus its unsharded fp32 gradient before reduce-scatter' if training else ''}"),
        ]
        if stage.weight_casts:
            corrections.append(correction("FSDP2 mixed precision instead of autocast copies", -stage.weight_casts,
                                          "allocated", "MixedPrecisionPolicy gathers parameters in the compute "
                                          "dtype, so the autocast copies of every weight kept for backward are not "
                                          "made"))
        return sharded + stage.buffers + stage.activations + inflight, corrections

    def communication_seconds(self, trace, gpus, precision, bytes_per_second, micro_batches=1):
        if gpus < 2 or not bytes_per_second:
            return 0.0
        # Parameters gathered (in the compute dtype) for forward and again for backward, fp32 gradients
        # reduce-scattered, on every micro batch this rank runs.
        micro_steps = max(1, micro_batches)
        compute_bytes = trace["parameter_bytes"] * (0.5 if precision in ("bf16", "fp16") else 1.0)
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
        blocks = max(int(trace.get("layers", 0) or 0), 1)
        wire = (gpus - 1) / gpus / bytes_per_second
        low = 0.5 if precision in ("bf16", "fp16") else 1.0
        layer, params = trace["largest_layer_bytes"], max(trace["parameter_bytes"], 1)
        root = max(0, params - layer * blocks)
        grad_share = trace["gradient_bytes"] / params   # trainable share: frozen weights send no gradient
        gather, scatter = layer * low * wire, layer * grad_share * wire
        root_gather, root_scatter = root * low * wire, root * grad_share * wire
        micro = max(1, micro_batches)
        per_block = compute_seconds / micro / blocks
        forward = root_gather + gather + (blocks - 1) * max(0.0, gather - per_block / 3)
        backward = gather + (blocks - 1) * max(0.0, gather + scatter - 2 * per_block / 3) + scatter + root_scatter
        exposed = min(total, micro * (forward + backward))
        return exposed, (f"overlapped as FSDP2 prefetches: {exposed / total:.0%} of the communication exposed (the "
                         "root's and the first block's gathers, the last reduce-scatters, and what any block's "
                         "communication takes beyond its compute)")
