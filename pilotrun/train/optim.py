"""Optimizers and learning-rate schedules the spec names."""
from __future__ import annotations

import math

import torch

from ..config.spec import OptimizerSpec, SchedulerSpec


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm weights (1-D) are not decayed, as in HF Trainer and nanoGPT."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: torch.nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
    groups = param_groups(model, spec.weight_decay)
    if not any(g["params"] for g in groups):
        raise ValueError("the model has no trainable parameters (every requires_grad is False)")
    if spec.name == "adamw":
        return torch.optim.AdamW(groups, lr=spec.lr, betas=(spec.betas[0], spec.betas[1]), eps=spec.eps)
    return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum)


class Schedule:
    """lr multiplier per update: linear warm-up, then constant, cosine or linear decay to ``min_ratio``.

    A plain object (not a lambda) so ``LambdaLR.state_dict()`` stores its fields and
    the schedule reloads from JSON, with no pickled code.
    """

    def __init__(self, name: str, warmup: int, total: int, min_ratio: float) -> None:
        self.name = name
        self.warmup = warmup
        self.total = total
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.name == "constant":
            return 1.0
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        if self.name == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, spec: SchedulerSpec, total_updates: int):
    schedule = Schedule(spec.name, spec.warmup_updates, total_updates, spec.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
