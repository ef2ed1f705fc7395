"""The data order, as arithmetic: (seed, epoch) fixes the permutation, (epoch, micro index) the position.

Because the position is two integers and the order is recomputed from the seed,
a restored run continues exactly where the saved one stopped, with or without
DataLoader workers (which prefetch ahead of what the loop has consumed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .rng import derived_seed


@dataclass(frozen=True)
class DataPlan:
    """The order of one rank's micro batches. With ``replicas`` > 1 every micro step takes
    ``micro_batch_size × replicas`` examples from the shared order and gives this ``rank`` its slice,
    so a window holds the same examples as one process with a ``replicas`` times larger micro batch."""

    n_examples: int
    micro_batch_size: int
    grad_accum_steps: int
    seed: int
    shuffle: bool = True
    drop_last: bool = False
    replicas: int = 1
    rank: int = 0

    @property
    def global_micro_batch(self) -> int:
        return self.micro_batch_size * self.replicas

    @property
    def micro_batches_per_epoch(self) -> int:
        step = self.global_micro_batch
        if self.drop_last:
            return self.n_examples // step
        full, rest = divmod(self.n_examples, step)
        # A last step too small to give every rank an example is dropped (all ranks must take part).
        return full + (1 if rest >= self.replicas else 0)

    @property
    def updates_per_epoch(self) -> int:
        return math.ceil(self.micro_batches_per_epoch / self.grad_accum_steps)

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n_examples))
        g = torch.Generator()
        g.manual_seed(derived_seed(self.seed * 1_000_003 + epoch))
        return torch.randperm(self.n_examples, generator=g).tolist()

    def micro_batch(self, epoch: int, index: int, order: list[int] | None = None) -> list[int]:
        order = self.order(epoch) if order is None else order
        step = self.global_micro_batch
        chunk = order[index * step : (index + 1) * step]
        if self.replicas == 1:
            return chunk
        k = len(chunk)
        return chunk[self.rank * k // self.replicas : (self.rank + 1) * k // self.replicas]

    def global_window_examples(self, micro_index: int, epoch: int = 0) -> int:
        """Examples in the whole window (all ranks) that starts at ``micro_index``."""
        n = self.window_size(micro_index)
        step = self.global_micro_batch
        start = micro_index * step
        return max(0, min(self.n_examples, start + n * step) - start)

    def window_size(self, micro_index: int) -> int:
        """Micro batches in the update window that starts at ``micro_index`` (the last of an epoch may be short)."""
        return min(self.grad_accum_steps, self.micro_batches_per_epoch - micro_index)


class PositionedBatchSampler(torch.utils.data.Sampler):
    """Yields micro-batch index lists from (epoch, micro index) onward, epoch after epoch."""

    def __init__(self, plan: DataPlan, epoch: int = 0, micro_index: int = 0) -> None:
        if plan.micro_batches_per_epoch < 1:
            raise ValueError(
                f"{plan.n_examples} training example(s) make no full micro batch of {plan.micro_batch_size} "
                "with data.drop_last; add data or lower train.micro_batch_size"
            )
        self.plan = plan
        self.epoch = epoch
        self.micro_index = micro_index

    def __iter__(self):
        epoch, index = self.epoch, self.micro_index
        while True:
            order = self.plan.order(epoch)
            while index < self.plan.micro_batches_per_epoch:
                yield self.plan.micro_batch(epoch, index, order)
                index += 1
            epoch, index = epoch + 1, 0

    def __len__(self) -> int:  # DataLoader asks; the stream is unbounded
        return 2**62
