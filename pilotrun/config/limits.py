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


BOUND_SEED = Bound("seed", 0, 2**32 - 1,
                   "numpy.random.seed takes 0..2**32-1 (torch.manual_seed up to 2**64-1, python's random any integer)")
BOUND_UPDATES = Bound("train.updates", 1, 1 << 53, "the lr schedule divides updates in float64, exact only up to 2**53")
BOUNDS = (
    BOUND_SEED,
    BOUND_UPDATES,
    Bound("train.grad_accum_steps", 1, 1 << 16,
          "the pilot runs every micro batch of a window in first_step; 65,536 of them is hours before one answer"),
    Bound("train.micro_batch_size", 1, 1 << 16, "the batch dimension of one forward; larger never fits a device"),
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
    Bound("pilot.resume.auto_within", 1, 100_000, "as pilot.resume.before"),
    Bound("train.scheduler.warmup_updates", 0, 1 << 53, "as train.updates"),
    Bound("model.adapter.r", 1, 1 << 16,
          "a LoRA update's rank is at most min(in, out) of its Linear; published layers stay below 65,536 features on "
          "one side (Llama 3 405B: 16,384 hidden, 53,248 MLP), so a larger rank only allocates (in+out)*r for nothing"),
)


# A campaign's own numbers (campaign.yaml), checked when it is loaded: a seed or a budget the run specs would refuse
# was blamed on the varied key ("train.optimizer.lr = 0.01 does not give a valid spec: seed: ...").
CAMPAIGN_BOUNDS = (
    Bound("seeds", BOUND_SEED.low, BOUND_SEED.high, BOUND_SEED.why),
    Bound("updates", 1, 1 << 53, "each run's train.updates: " + BOUND_UPDATES.why),
    Bound("eval.every", 1, 1 << 53, "as updates"),
    Bound("keep.control_set", 0, 100_000, "validation examples whose predictions every run keeps in the ledger"),
)


@dataclass(frozen=True)
class FloatBound:
    """A real-valued range; ``low_open``/``high_open``: the end itself is outside."""

    field: str
    low: float
    high: float
    low_open: bool
    high_open: bool
    why: str

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def text(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


INF = float("inf")
FLOAT_BOUNDS = (
    FloatBound("train.optimizer.lr", 0.0, 100.0, True, False,
               "each update moves a weight by about lr (Adam) or lr times its gradient (SGD); the largest published "
               "peak rates are around 10 to 30 (large-batch LARS), so above 100 the value is a typo (1e3 for 1e-3) "
               "and the run diverges at its first update"),
    FloatBound("train.optimizer.betas[0]", 0.0, 1.0, False, True,
               "torch.optim.AdamW refuses betas outside [0, 1) (at 1 the moment never forgets and its bias correction "
               "divides by 0)"),
    FloatBound("train.optimizer.betas[1]", 0.0, 1.0, False, True, "as train.optimizer.betas[0]"),
    FloatBound("train.optimizer.eps", 0.0, INF, False, True, "torch.optim.AdamW refuses a negative epsilon"),
    FloatBound("train.optimizer.momentum", 0.0, 1.0, False, True,
               "torch.optim.SGD refuses a negative momentum; at 1 or above the velocity never decays and every past "
               "gradient keeps (or grows) its weight"),
)

# model.config keys that count repeated blocks: transformers builds each one in a Python loop, so
# 2**31 of them never finishes. The deepest published transformers have a few hundred layers.
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "num_encoder_layers",
              "encoder_layers", "decoder_layers")
MAX_LAYERS = 1024

# model.config keys that are sizes (widths, head counts, vocabulary, positions): transformers accepts 0 and then fails
# while building or in the first forward with an IndexError or ZeroDivisionError that names no key (found by the
# fuzzer: vocab_size 0, num_attention_heads 0). The bound above is data.max_length's, far above published models
# (Gemma's 262,144-token vocabulary, 10M-token contexts).
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "max_position_embeddings", "n_embd", "n_head", "n_positions", "n_ctx", "n_inner", "d_model",
             "d_ff", "d_kv", "num_heads", "ffn_dim", "encoder_attention_heads", "decoder_attention_heads",
             "encoder_ffn_dim", "decoder_ffn_dim", "moe_intermediate_size", "num_experts", "num_local_experts",
             "num_experts_per_tok")
MAX_SIZE = 1 << 24


def _get(spec: Any, dotted: str) -> Any:
    """The value at ``dotted`` (``a.b[1]`` indexes a tuple), or None where a section is absent."""
    obj = spec
    for part in dotted.split("."):
        name, _, index = part.partition("[")
        obj = getattr(obj, name, None)
        if index and isinstance(obj, (list, tuple)):
            i = int(index.rstrip("]"))
            obj = obj[i] if i < len(obj) else None
    return obj


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_problem(b: Bound, value: Any, field: str | None = None) -> tuple[str, str] | None:
    """``value`` against ``b`` as (field, message), or None when it holds (or is not an integer)."""
    if _int(value) and not b.low <= value <= b.high:
        return field or b.field, f"{value} is outside {b.low:,}..{b.high:,}: {b.why}"
    return None


BOUND = {b.field: b for b in BOUNDS}


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity mask
        return os.cpu_count() or 1


def bound_problems(spec: Any, this_machine: bool) -> list[tuple[str, str]]:
    """Every number outside its range, as (field, message naming the range and its reason).
    ``this_machine``: also check what depends on the machine running the job (DataLoader workers)."""
    problems = [p for b in BOUNDS if (p := int_problem(b, _get(spec, b.field))) is not None]
    for fb in FLOAT_BOUNDS:
        value = _get(spec, fb.field)
        if isinstance(value, float) and not fb.holds(value):
            problems.append((fb.field, f"{value:g} is outside {fb.text()}: {fb.why}"))
    if spec.model is not None:
        problems += config_size_problems(spec.model.config or {})
    if this_machine and spec.data is not None:
        cores = usable_cores()
        if spec.data.num_workers > cores:
            problems.append(("data.num_workers", f"{spec.data.num_workers} DataLoader worker processes on a machine "
                             f"where this process may use {cores} core(s): use at most {cores}"))
    return problems


def config_size_problems(config: dict) -> list[tuple[str, str]]:
    """model.config's layer counts and sizes in range, and its attention heads shared evenly by the key/value heads."""
    problems = []
    for key in LAYER_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_LAYERS:
            problems.append((f"model.config.{key}", f"{value} is outside 0..{MAX_LAYERS}: transformers builds each "
                             "layer in a Python loop, and the deepest published models have a few hundred"))
    for key in SIZE_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= MAX_SIZE:
            problems.append((f"model.config.{key}", f"{value} is outside 1..{MAX_SIZE:,}: sizes start at 1 (0 fails "
                             "inside transformers with an error that names no key) and published models stay far "
                             "below the upper end"))
    heads, kv, hidden = (config.get(k) for k in ("num_attention_heads", "num_key_value_heads", "hidden_size"))
    if isinstance(heads, int) and isinstance(kv, int) and heads >= 1 and kv >= 1 and heads % kv:
        problems.append(("model.config.num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}: each "
                         "key/value head serves the same number of query heads; use a divisor of it"))
    if isinstance(heads, int) and isinstance(hidden, int) and 1 <= hidden < heads and "head_dim" not in config:
        problems.append(("model.config.num_attention_heads", f"{heads} heads of hidden_size {hidden} leave each head "
                         "hidden_size // num_attention_heads = 0 features; use at most hidden_size heads (or set "
                         "head_dim)"))
    return problems
