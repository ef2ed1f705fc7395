"""Which variants run beside the control, what each sets, and what it holds and changes (pure: spec in, data out).

A variant is the control's spec with a few keys set (as ``--set`` takes them). The fixes of
docs/guides/fix-memory.md keep the question: micro batch ÷2 with accumulation ×2 (examples per update held),
activation checkpointing, a precision. A variant that changes what is learned — fewer examples per update, a
shorter maximum length, other data, other trainable parameters (an adapter) — is a different experiment, and is
labelled so whatever it saves.

Example::

    plans = plan_variants(spec)                       # [Variant("micro-batch-half", {...}), ...]
    plans[0].overrides                                # ["train.micro_batch_size=4", "train.grad_accum_steps=4"]
    held, changed = compare_specs(control, variant)   # what the variant kept and what it moved
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..config.sections import AC_POLICIES, BUILTIN_VARIANTS, ac_policy, ac_spec_value, ac_variant, ac_words
from ..config.spec import dotted
from ..ledger.records import TextEnum


class Kind(TextEnum):
    """What a variant is, for the advisor and the rows."""

    CONTROL = "control"          # the spec as written
    MEMORY_FIX = "memory-fix"    # docs/guides/fix-memory.md's fixes: the same question, other memory and time
    OWN = "own"                  # pilot.variants.custom: the user's; a memory fix only if it holds the question
    FASTER_PATH = "faster-path"  # fp8: no memory saved, judged on its numerics (and its time where the device has FP8)


# The keys whose change makes a variant a different experiment (what is learned, from which examples):
# docs/guides/fix-memory.md, "Same or different experiment" (an adapter is another experiment, never a memory fix).
QUESTION_KEYS = ("data", "model.adapter", "model.quantization", "model.config", "model.name", "model.factory",
                 "eval.max_length", "train.updates", "train.optimizer", "train.scheduler", "seed")


@dataclass(frozen=True)
class Variant:
    name: str
    kind: Kind
    settings: dict[str, Any]      # dotted key -> value
    what: str                     # one line for people: what it is meant to do
    # The configuration its numerics, time and memory are compared with: None, the control; else another variant's
    # name (fp8 against bf16 when the control trains in another precision: float8's own difference, not bf16's).
    against: str | None = None

    @property
    def overrides(self) -> list[str]:
        """The settings as ``--set`` takes them (values as JSON, which the loader reads as YAML)."""
        return [f"{k}={json.dumps(v)}" for k, v in self.settings.items()]


@dataclass
class Skipped:
    name: str
    why: str


@dataclass
class Planned:
    run: list[Variant] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def builtin(name: str, spec) -> Variant | Skipped:
    """One of the fixes (docs/guides/fix-memory.md) for this control, or why it does not apply to it."""
    t = spec.train
    if name == "micro-batch-half":
        if t.micro_batch_size < 2 or t.micro_batch_size % 2:
            return Skipped(name, f"the micro batch is {t.micro_batch_size}: it cannot be halved exactly")
        return Variant(name, Kind.MEMORY_FIX,
                       {"train.micro_batch_size": t.micro_batch_size // 2,
                        "train.grad_accum_steps": t.grad_accum_steps * 2},
                       f"micro batch {t.micro_batch_size // 2} x {t.grad_accum_steps * 2} accumulation "
                       f"(examples per update held at {t.micro_batch_size * t.grad_accum_steps})")
    if (policy := next((p for p in AC_POLICIES if ac_variant(p) == name), None)) is not None:
        if ac_policy(t.activation_checkpointing) == policy:
            return Skipped(name, f"the control already uses it (train.activation_checkpointing: "
                                 f"{t.activation_checkpointing})")
        return Variant(name, Kind.MEMORY_FIX, {"train.activation_checkpointing": ac_spec_value(policy)},
                       f"{ac_words(policy)}: recompute activations in backward")
    if name in ("bf16", "fp16", "bf16-true", "bf16-true-autocast"):
        if t.precision == name:
            return Skipped(name, f"the control already trains in {name}")
        what = {"bf16": "bf16 autocast over fp32 weights",
                "fp16": "fp16 autocast with a grad scaler stepped per update",
                "bf16-true": "weights, gradients and optimizer state in bf16",
                "bf16-true-autocast": "weights, gradients and optimizer state in bf16, with bf16 autocast over "
                                      "them"}[name]
        return Variant(name, Kind.MEMORY_FIX, {"train.precision": name}, what)
    if name == "fp8":
        return _fp8(spec)
    raise ValueError(f"unknown built-in variant {name!r}")


FP8_WHAT = ("bf16 autocast over fp32 weights with the Linears' matmuls in float8 (torchao float8 training, "
            "train.fp8_recipe {recipe})")


def _fp8(spec) -> Variant | Skipped:
    t = spec.train
    if t.precision == "fp8":
        return Skipped("fp8", "the control already trains in fp8")
    if spec.model.adapter is not None or spec.model.quantization is not None:
        return Skipped("fp8", "fp8 trains the full model's Linears, not an adapter or a quantised base")
    return Variant("fp8", Kind.FASTER_PATH, {"train.precision": "fp8"}, FP8_WHAT.format(recipe=t.fp8_recipe),
                   against=None if t.precision == "bf16" else "bf16")


def plan_variants(spec) -> Planned:
    """The variants ``pilotrun variants`` runs for this spec (``pilot.variants``), in the order of
    docs/guides/fix-memory.md, and those it does not, with why."""
    cfg = spec.pilot.variants
    out = Planned()
    names = list(cfg.run if cfg.run is not None else BUILTIN_VARIANTS)
    if "fp8" in names and "bf16" not in names and spec.train.precision not in ("bf16", "fp8"):
        names.insert(names.index("fp8"), "bf16")  # fp8's reference: its numerics are read against bf16's
    for name in names:
        v = builtin(name, spec)
        if isinstance(v, Skipped):
            out.skipped.append(v)
        else:
            out.run.append(v)
    for name, keys in cfg.custom.items():
        out.run.append(Variant(name, Kind.OWN, dict(keys), "pilot.variants.custom: " + ", ".join(
            f"{k}={v}" for k, v in keys.items())))
    return out


@dataclass(frozen=True)
class Difference:
    changed: dict[str, tuple[Any, Any]]   # dotted key -> (control's, variant's)
    held: list[str]                       # what the comparison needs held, said as facts
    question: list[str]                   # the changed keys that change the experiment

    @property
    def same_question(self) -> bool:
        return not self.question


def compare_specs(control, variant) -> Difference:
    """What the variant's spec changes from the control's, and which of the changes move the question."""
    a, b = dotted(control.canonical()), dotted(variant.canonical())
    changed = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    question = [k for k in changed if any(k == q or k.startswith(q + ".") for q in QUESTION_KEYS)]
    ca, cb = control.train, variant.train
    per_a, per_b = ca.micro_batch_size * ca.grad_accum_steps, cb.micro_batch_size * cb.grad_accum_steps
    if per_a != per_b:
        question.append("examples per update")
    if control.data.max_length != variant.data.max_length:
        question.append("data.max_length")
    held = [f"examples per update {per_b}" + (" (held)" if per_a == per_b else f" (the control's {per_a})"),
            f"max length {variant.data.max_length}" + ("" if control.data.max_length == variant.data.max_length
                                                        else f" (the control's {control.data.max_length})")]
    return Difference(changed, held, sorted(set(question)))
