"""Ranges a spec's numbers must fall in before anything runs, each with its source.

The schema checks types; these bounds check sizes that would otherwise fail deep inside a gate
with a message that names nothing (a seed torch cannot unpack), or never answer (a million
DataLoader workers, 2**31 accumulated micro batches or layers). A bound is a fact with a reason,
never a guess at what a job "should" use: each is far above real jobs and below the failure.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bound:
    field: str     # dotted spec field
    low: int
    high: int
    why: str       # the source of the range


BOUNDS = (
    Bound("seed", 0, 2**32 - 1,
          "numpy.random.seed accepts 0..2**32-1 (torch.manual_seed up to 2**64-1, python's random any integer)"),
    Bound("train.grad_accum_steps", 1, 1 << 16,
          "the pilot runs every micro batch of a window in first_step; 65,536 of them is hours before one answer"),
    Bound("train.micro_batch_size", 1, 1 << 16, "the batch dimension of one forward; larger never fits a device"),
    Bound("train.updates", 1, 1 << 53, "the lr schedule divides updates in float64, exact only up to 2**53"),
    Bound("data.max_length", 2, 1 << 24, "16M tokens per example is above every published context length"),
    Bound("eval.max_length", 1, 1 << 24, "as data.max_length"),
    Bound("eval.batch_size", 1, 1 << 16, "as train.micro_batch_size"),
    Bound("eval.max_batches", 1, 1 << 20, "validation batches the eval gate runs before it answers"),
    Bound("pilot.updates", 2, 100_000, "updates the pilot runs before it answers (the default is 6)"),
    Bound("pilot.inspect.examples", 0, 10_000, "examples printed in full by inspect"),
    Bound("pilot.overfit.examples", 1, 100_000, "examples the overfit gate memorises"),
    Bound("pilot.overfit.max_updates", 1, 1_000_000, "updates the overfit gate may run before it answers"),
    Bound("pilot.overfit.micro_batch_size", 1, 1 << 16, "as train.micro_batch_size"),
    Bound("pilot.overfit.check_every", 1, 1_000_000, "as pilot.overfit.max_updates"),
    Bound("pilot.resume.before", 1, 100_000, "updates each resume process runs before it answers"),
    Bound("pilot.resume.after", 1, 100_000, "as pilot.resume.before"),
    Bound("train.scheduler.warmup_updates", 0, 1 << 53, "as train.updates"),
)

# model.config keys that count repeated blocks: transformers builds each one in a Python loop, so
# 2**31 of them never finishes. The deepest published transformers have a few hundred layers.
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "num_encoder_layers",
              "encoder_layers", "decoder_layers")
MAX_LAYERS = 1024


def _get(spec: Any, dotted: str) -> Any:
    obj = spec
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity mask
        return os.cpu_count() or 1


def bound_problems(spec: Any, this_machine: bool) -> list[tuple[str, str]]:
    """Every number outside its range, as (field, message naming the range and its reason).
    ``this_machine``: also check what depends on the machine running the job (DataLoader workers)."""
    problems = []
    for b in BOUNDS:
        value = _get(spec, b.field)
        if isinstance(value, int) and not isinstance(value, bool) and not b.low <= value <= b.high:
            problems.append((b.field, f"{value} is outside {b.low:,}..{b.high:,}: {b.why}"))
    config = spec.model.config or {}
    for key in LAYER_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_LAYERS:
            problems.append((f"model.config.{key}", f"{value} is outside 0..{MAX_LAYERS}: transformers builds each "
                             "layer in a Python loop, and the deepest published models have a few hundred"))
    if this_machine:
        cores = usable_cores()
        if spec.data.num_workers > cores:
            problems.append(("data.num_workers", f"{spec.data.num_workers} DataLoader worker processes on a machine "
                             f"where this process may use {cores} core(s): use at most {cores}"))
    return problems
