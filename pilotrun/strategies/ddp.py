"""DDP: a full replica per process, gradients all-reduced once per update (``no_sync`` on earlier micro batches)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import backends
from .base import BufferSync, DistributedCheckpoint, StageBytes, correction, probe_reduction, reduction_probe


class DDP(DistributedCheckpoint):
    name = "ddp"
    description = "a full replica per process, gradients all-reduced"

    def wrap(self, model, env, device):
        ids = backends.for_device(device).ddp_device_ids(device)
        return (torch.nn.parallel.DistributedDataParallel(model, device_ids=ids),
                f"DDP over {env.world_size} processes ({dist.get_backend()})")

    def buffer_sync(self, model):
        # DistributedDataParallel.forward broadcasts rank 0's buffers to every rank before computing
        # (broadcast_buffers=True, the default and what wrap() builds), so each rank's own running
        # statistics after its last forward are overwritten: rank 0's copy is the state.
        if getattr(model, "broadcast_buffers", False):
            return BufferSync(0, "DDP broadcasts rank 0's buffers to every rank at each forward (broadcast_buffers="
                                 "True), so that copy is the training state and the one the checkpoint holds")
        return BufferSync(None, "DDP runs with broadcast_buffers=False: each rank keeps its own buffers, and the "
                                "checkpoint holds one copy for all ranks; if the copies differ, use "
                                "torch.nn.SyncBatchNorm.convert_sync_batchnorm (GPU only) or broadcast_buffers=True")

    def reduction_ratio(self, env, device):
        probe = reduction_probe(device)
        ids = backends.for_device(device).ddp_device_ids(device)
        wrapped = torch.nn.parallel.DistributedDataParallel(probe, device_ids=ids)
        return probe_reduction(wrapped, probe, device)

    def micro_batch(self, model, index, count):
        # One all-reduce per update, on the last micro batch; no_sync covers the forward as well as the backward.
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and index < count - 1:
            return model.no_sync()
        return contextlib.nullcontext()

    def estimate_memory(self, stage: StageBytes, trace: dict, gpus: int, training: bool):
        if gpus < 2:
            return stage.total, []
        buckets = trace["gradient_bytes"]
        return stage.total + buckets, [correction(
            "DDP gradient buckets", buckets, "allocated",
            "DDP keeps a flat copy of every gradient for all-reduce (gradient_as_bucket_view=False)")]

    def communication_seconds(self, trace, gpus, precision, bytes_per_second, micro_batches=1):
        if gpus < 2 or not bytes_per_second:
            return 0.0
        return 2 * trace["gradient_bytes"] * (gpus - 1) / gpus / bytes_per_second  # one all-reduce per update
