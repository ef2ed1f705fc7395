"""Optimizers and learning-rate schedules the spec names."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config.sections import OptimizerSpec, SchedulerSpec


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


class OptimizerError(ValueError):
    """The optimizer cannot be built as specified; ``field`` is the spec key to change (exit 2 before a run)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class OptimizerChoice:
    """What was built and why: recorded by the load gate (and so in the ledger)."""

    name: str
    fused: bool | None  # torch AdamW only: whether the fused kernel runs; None for other optimizers
    reason: str


def fused_support(device: torch.device, dtypes: set[torch.dtype]) -> str | None:
    """None when torch has a fused AdamW kernel for this device type and these parameter dtypes; else why not.
    The rule torch itself enforces (torch/optim/adamw.py: fused needs floating-point tensors on a device type in
    ``torch.utils._foreach_utils._get_fused_kernels_supported_devices()``)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    if device.type not in devices:
        return f"torch {torch.__version__} has no fused AdamW kernel for {device.type} (it has: {', '.join(devices)})"
    odd = sorted(str(d).replace("torch.", "") for d in dtypes if not d.is_floating_point)
    if odd:
        return f"the fused AdamW kernel needs floating-point parameters, these are {', '.join(odd)}"
    return None


def choose_fused(spec: OptimizerSpec, device: torch.device, dtypes: set[torch.dtype]) -> tuple[bool | None, str]:
    """Whether torch's AdamW runs fused, and why. ``auto`` uses the fused kernel on accelerators where torch has
    one; on CPU it keeps torch's own default (the for-loop kernel): torch never picks fused by itself, and CPU
    pilots stay comparable with earlier ones. ``true`` where no kernel exists raises :class:`OptimizerError`."""
    if spec.name != "adamw":
        return None, f"{spec.name}: optimizer.fused applies to adamw only"
    problem = fused_support(device, dtypes)
    if spec.fused is True:
        if problem is not None:
            raise OptimizerError("train.optimizer.fused", f"is true but {problem}; set it to auto or false")
        return True, "train.optimizer.fused: true (the fused kernel required)"
    if spec.fused is False:
        return False, "train.optimizer.fused: false: torch's default kernel"
    if problem is not None:
        return False, f"fused: auto chose the default kernel: {problem}"
    if device.type == "cpu":
        return False, ("fused: auto chose the default kernel on CPU: torch itself never defaults to fused, and CPU "
                       "pilots stay comparable with earlier runs (fused: true uses torch's fused CPU kernel)")
    return True, f"fused: auto chose torch's fused AdamW kernel (available for {device.type})"


# Adafactor as most fine-tuning scripts configure it (transformers.optimization.Adafactor's docstring, "Others
# reported the following combination to work well"): the spec's lr, no relative step, no parameter scaling, no
# warm-up init. pilotrun's scheduler then shapes the lr as for every optimizer.
ADAFACTOR = {"relative_step": False, "scale_parameter": False, "warmup_init": False}


def build_optimizer(model: torch.nn.Module, spec: OptimizerSpec, device: torch.device | None = None,
                    ) -> torch.optim.Optimizer:
    """The optimizer over the trainable parameters only (a frozen base gets no state)."""
    return build_optimizer_choice(model, spec, device)[0]


def build_optimizer_choice(model: torch.nn.Module, spec: OptimizerSpec, device: torch.device | None = None,
                           ) -> tuple[torch.optim.Optimizer, OptimizerChoice]:
    """:func:`build_optimizer` plus the choice it made and why (fused or not)."""
    groups = param_groups(model, spec.weight_decay)
    params = [p for g in groups for p in g["params"]]
    if not params:
        raise ValueError("the model has no trainable parameters (every requires_grad is False)")
    device = device or params[0].device
    betas = (spec.betas[0], spec.betas[1])
    if spec.name == "adamw":
        fused, why = choose_fused(spec, device, {p.dtype for p in params})
        opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=spec.lr, betas=betas, eps=spec.eps,
                                                       fused=True if fused else None)
        return opt, OptimizerChoice("adamw", fused, why)
    if spec.name in ("adamw8bit", "paged_adamw8bit"):
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if spec.name == "paged_adamw8bit" else bnb.optim.AdamW8bit
        # bitsandbytes keeps 32-bit state for tensors under min_8bit_size (4096) elements: its default, kept.
        opt = cls(groups, lr=spec.lr, betas=betas, eps=spec.eps)
        return opt, OptimizerChoice(spec.name, None, f"{cls.__name__} (bitsandbytes): 8-bit blockwise state for "
                                                       "tensors of 4096+ elements, 32-bit below")
    if spec.name == "adafactor":
        from transformers.optimization import Adafactor

        opt = Adafactor(groups, lr=spec.lr, **ADAFACTOR)
        return opt, OptimizerChoice("adafactor", None, "Adafactor (transformers): factored second moment, no first "
                                                       "moment; relative_step, scale_parameter, warmup_init off")
    return (torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum),
            OptimizerChoice("sgd", None, f"SGD, momentum {spec.momentum:g}"))


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
