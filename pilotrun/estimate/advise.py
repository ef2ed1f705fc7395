"""What to change when a stage does not fit: combinations of fixes in order of cost, each with its predicted
memory and time, up to the cheapest one that fits.

The fixes, cheapest first (the fix order of docs/architecture.md, "Contracts"):

1. smaller micro batch, more accumulation (examples per update held: the same experiment);
2. activation checkpointing, its cheapest policy first (selective: the matmul outputs kept; selective-2: one matmul
   in 2 kept; one block in 2; every block), memory saved vs time added, both predicted (the time measured, where
   ``pilotrun variants`` ran it there);
3. mixed precision (bf16, or fp16 with a grad scaler stepped on the real update boundary);
4. sharding with FSDP2 across 2, 4, 8... GPUs (each count dearer than the last);
5. CPU offload of the sharded state (FSDP2's CPUOffloadPolicy), once nothing over the GPUs of one node fits;
6. sharding across nodes, then a larger accelerator (each larger one dearer than the last).

A combination costs what its dearest fix costs, then what the next dearest costs, and so on: FSDP2 over 2 GPUs
with checkpointing is tried after FSDP2 over 2 alone and before FSDP2 over 4, because two GPUs with a recompute
cost less than four. One knob at a time would miss it (issue 13: on an H100 the 7B fits as FSDP2 x2 +
checkpointing, which the one-knob list never offered).

Cutting the maximum length is never proposed: it changes the question, not the cost. Nor is an adapter (LoRA,
QLoRA) or a quantised base: training other parameters changes the experiment, not its cost. ``select
--other-experiments`` lists them beside the job, labelled as different experiments (``experiments.py``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum

from .. import strategies
from ..config.sections import AC_POLICIES, ac_policy, ac_spec_value, ac_variant, ac_words
from ..ledger.records import GateName
from .catalog import Accelerator
from .measured import MeasuredFixes, seconds_with_recompute, with_measured_peak
from .model import estimate_fit


class MemorySource(str, Enum):
    """Where a row's memory comes from: the fix's trace, or what ``pilotrun variants`` measured of it."""

    TRACE = "trace"
    MEASURED = "measured"


@dataclass(frozen=True)
class Combination:
    """Fix levels, each 0 when unused; sorting by ``cost`` is the order of docs/architecture.md."""

    accelerator: Accelerator
    accelerator_level: int = 0     # 0: the one asked about; k: the k-th larger in the catalog
    gpus: int = 1                  # FSDP2 ranks when sharding is used
    shard_level: int = 0           # 0: the strategy asked about; k: the k-th sharding step
    precision: bool = False        # bf16 instead of fp32
    checkpointing: str | None = None  # a policy (AC_POLICIES, cheapest recompute first), None: off
    smaller_micro_batch: bool = False
    offload: bool = False          # FSDP2's CPUOffloadPolicy (distributed.offload: cpu)

    @property
    def cost(self) -> tuple:
        ac = 0 if self.checkpointing is None else 1 + AC_POLICIES.index(self.checkpointing)
        # CPU offload keeps the GPUs the job has but slows every update (each shard over PCIe in and out, the optimizer
        # step on the CPU): it is the last resort on one node, after checkpointing, precision and sharding over that
        # node's GPUs, and before sharding across nodes or a larger accelerator, which cost rented hardware instead.
        beyond_node = self.shard_level > 0 and self.gpus > int(self.accelerator.interconnect.get("gpus_per_node") or 8)
        return (self.accelerator_level, beyond_node, self.offload, self.shard_level, self.precision, ac,
                self.smaller_micro_batch)

    def name(self) -> str:
        parts = []
        if self.accelerator_level:
            parts.append(f"a larger accelerator ({self.accelerator.name})")
        if self.shard_level:
            parts.append(f"FSDP2 over {self.gpus} GPUs")
        if self.precision:
            parts.append("mixed precision (bf16)")
        if self.checkpointing:
            parts.append(ac_words(self.checkpointing))
        if self.smaller_micro_batch:
            parts.append("smaller micro batch, more accumulation")
        if self.offload:
            parts.append("CPU offload (FSDP2 CPUOffloadPolicy)")
        return " + ".join(parts)


def combinations(spec, acc: Accelerator, strategy: str, gpus: int,
                 catalog: dict[str, Accelerator]) -> list[Combination]:
    """Every combination of the fixes that apply to ``spec``, cheapest first (the empty one left out)."""
    t = spec.train
    per_node = int(acc.interconnect.get("gpus_per_node", 8))
    # Already sharded over `gpus`: only more ranks are a further fix.
    sharded = strategies.get(strategy).shards
    shards = [0] + [n for n in (2, 4, 8, 16) if n <= per_node * 2 and not (sharded and n <= gpus)]
    # Meaningfully larger (10% or more), not a rounding of the same class.
    larger = sorted((a for a in catalog.values() if a.memory_bytes >= acc.memory_bytes * 1.10),
                    key=lambda a: a.memory_bytes)
    # Offload where the spec does not already: on a strategy that can (the sharding fix's, or the one asked about)
    # over 2+ GPUs (one process runs the one-process strategy, which keeps its state on the device).
    offloads = (False, True) if spec.distributed.offload == "none" else (False,)
    out = []
    for level, accel in enumerate([acc, *larger]):
        for shard_level, n in enumerate(shards):
            can_offload = (strategies.sharding() if shard_level else strategies.get(strategy)).offloads
            for prec, ac, mb, off in itertools.product(
                    (False, True) if t.precision == "fp32" else (False,),
                    (None, *AC_POLICIES) if not ac_policy(t.activation_checkpointing) else (None,),
                    (False, True) if t.micro_batch_size > 1 else (False,), offloads):
                c = Combination(accel, level, n if shard_level else gpus, shard_level, prec, ac, mb, off)
                if off and not (can_offload and c.gpus > 1):
                    continue
                if any(c.cost):
                    out.append(c)
    return sorted(out, key=lambda c: c.cost)


# What each policy recomputes, for the reason (the selective policy recomputes no matmul: only memory traffic).
RECOMPUTES = {"full": "the forward is recomputed in backward",
              "selective": "every op but the matmuls is recomputed in backward (the time counts their bytes; "
                           "pilotrun variants measures them)",
              "selective-2": "every op but the attention and one matmul in 2 is recomputed in backward (the time "
                             "counts the other matmuls' FLOPs again; pilotrun variants measures them)",
              "every-2": "one block in 2 is recomputed in backward"}


# The only keys a fix may change (docs/architecture.md "fix order"); model.* (adapter, quantization) never.
FIX_KEYS = frozenset({"accelerator", "distributed.strategy", "distributed.offload", "gpus", "train.precision",
                      "train.activation_checkpointing", "train.micro_batch_size", "train.grad_accum_steps"})


@dataclass
class Advice:
    """One combination of fixes the advisor offers for a job that does not fit: what it changes in the spec, its
    fit and time, and why (``estimate --json``'s ``advice`` entries are its JSON form)."""

    variant: str                # the combination's name ("bf16 + checkpointing")
    changes: dict               # spec keys it sets (FIX_KEYS only): what a user would write
    experiment: str             # "same experiment", or why it is a variant of its own
    reason: str                 # what each fix does here, measured where `pilotrun variants` measured it
    accelerator: str
    strategy: str
    gpus: int
    device_used_bytes: int
    peak_allocated_bytes: int
    capacity_bytes: int
    fits: bool
    seconds_per_update: float | None
    memory_source: MemorySource = MemorySource.TRACE
    time_factor: float | None = None     # seconds per update against the job as it is
    cheapest_that_fits: bool = False     # the first that fits in the order of cost (the advisor stops there)

    def to_json(self) -> dict:
        return {"variant": self.variant, "changes": self.changes, "experiment": self.experiment,
                "reason": self.reason, "accelerator": self.accelerator, "strategy": self.strategy, "gpus": self.gpus,
                "device_used_bytes": self.device_used_bytes, "peak_allocated_bytes": self.peak_allocated_bytes,
                "capacity_bytes": self.capacity_bytes, "fits": self.fits,
                "seconds_per_update": self.seconds_per_update, "memory_source": self.memory_source.value,
                "time_factor": self.time_factor, "cheapest_that_fits": self.cheapest_that_fits}


def _row(c: Combination, fit: dict, base_s: float | None, changes: dict, experiment: str, why: str) -> Advice:
    assert set(changes) <= FIX_KEYS, f"a fix may not change {sorted(set(changes) - FIX_KEYS)}"
    s = fit["seconds_per_update"]
    return Advice(c.name(), changes, experiment, why, fit["accelerator"], fit["strategy"], fit["gpus"],
                  fit["device_used_bytes"], fit["peak_allocated_bytes"], fit["capacity_bytes"], fit["fits"], s,
                  MemorySource(fit.get("memory_source", MemorySource.TRACE)),
                  (s / base_s) if s and base_s else None)


def _micro_batches(spec) -> list[int]:
    """Smaller micro batches that hold the examples per update exactly, largest first."""
    t = spec.train
    examples = t.micro_batch_size * t.grad_accum_steps
    return [m for m in range(t.micro_batch_size - 1, 0, -1) if examples % m == 0]


def evaluate(spec, traces, c: Combination, strategy: str, base_s: float | None,
             utilisation: float | None, measured: MeasuredFixes | None = None) -> Advice:
    """One combination's row: the trace it needs, its fit, and what it changes in the spec. Where ``pilotrun
    variants`` measured checkpointing's recompute cost on this accelerator, that ratio replaces the FLOPs ratio in
    the time; elsewhere the measurement is quoted beside the prediction."""
    t = spec.train
    trace = traces.get(ac=ac_spec_value(c.checkpointing) if c.checkpointing else None,
                       precision="bf16" if c.precision else None)
    strat = strategies.sharding().name if c.shard_level else strategy
    util = utilisation if not c.accelerator_level else None  # a pilot's utilisation is per accelerator
    changes: dict = {}
    why: list[str] = []
    experiment = "same experiment"
    if c.accelerator_level:
        changes["accelerator"] = c.accelerator.name
        why.append(f"{c.accelerator.memory_bytes / 2**30:.0f} GiB per device")
    if c.shard_level:
        changes |= {"distributed.strategy": strat, "gpus": c.gpus}
        experiment = "same experiment if examples per update are held (accumulation divided by the replicas)"
        why.append("parameters, gradients and optimizer state sharded; activations per rank unchanged")
    if c.precision:
        changes["train.precision"] = "bf16"
        experiment = "a variant: numerics change, record it as its own experiment"
        why.append("bf16 autocast with fp32 master weights; on hardware without bf16, fp16 with a grad scaler "
                   "stepped once per update")
    recompute = None
    if c.checkpointing:
        changes["train.activation_checkpointing"] = ac_spec_value(c.checkpointing)
        base_flops = traces.get()["stages"][GateName.STEADY_STEP]["flops"]
        flops = f"{trace['stages'][GateName.STEADY_STEP]['flops'] / base_flops:.2f}x FLOPs"
        what = RECOMPUTES[c.checkpointing]
        name = ac_variant(c.checkpointing)
        recompute, said = measured.time_factor(name, c.accelerator) if measured else (None, "")
        if recompute is not None:
            why.append(f"{what}: {said} (the FLOPs predicted {flops})")
        else:
            why.append(f"{what} ({flops}" + (f"; {said}" if said else "") + ")")
        if measured and (mem := measured.memory_text(name)):
            why.append(mem)
    offload = "cpu" if c.offload else None   # None: the spec's own
    if c.offload:
        changes["distributed.offload"] = "cpu"
    fit = estimate_fit(trace, c.accelerator, strat, c.gpus, utilisation=util, offload=offload)
    if c.offload:
        host = (fit["host_memory"] or {}).get("note")
        why.append(f"parameters, gradients and optimizer state kept in host memory ({host}); every update copies "
                   "each shard over PCIe and runs the optimizer step on the CPU")
    scale = 1.0
    if c.smaller_micro_batch:
        # The largest smaller micro batch that fits; the smallest when none does (to show how far it is).
        sizes = _micro_batches(spec)
        for mb in sizes:
            fit = estimate_fit(trace, c.accelerator, strat, c.gpus, utilisation=util,
                               micro_scale=mb / t.micro_batch_size, offload=offload)
            if fit["fits"]:
                break
        scale = mb / t.micro_batch_size
        accum = t.micro_batch_size * t.grad_accum_steps // mb
        changes |= {"train.micro_batch_size": mb, "train.grad_accum_steps": accum}
        why.append(f"{mb} x {accum} = {mb * accum} examples per update, as before; activations scale with the "
                   "micro batch")
    # The measured recompute ratio times the configuration without offload: kept to rows that do not offload.
    if recompute is not None and not c.offload and (s := seconds_with_recompute(
            traces, c.accelerator, strat, c.gpus, util, scale, recompute, "bf16" if c.precision else None)):
        fit = {**fit, "seconds_per_update": s}
    fit = _measured_memory(traces, c, strat, util, fit, measured, why)
    return _row(c, fit, base_s, changes, experiment, "; ".join(why))


def _measured_memory(traces, c: Combination, strategy: str, utilisation: float | None, fit: dict,
                     measured: MeasuredFixes | None, why: list[str]) -> dict:
    """A fix measured alone on this accelerator (``pilotrun variants`` runs one device) replaces the traced saving:
    the configuration without it x the measured peak ratio. Combined with another fix, or sharded, the ratio of
    one device alone does not hold, and the trace stands."""
    fixes = ([ac_variant(c.checkpointing)] if c.checkpointing else []) + (["bf16"] if c.precision else [])
    others = c.shard_level or c.smaller_micro_batch or c.accelerator_level or c.offload
    if measured is None or others or len(fixes) != 1 or strategies.get(strategy).compute_replicas(c.gpus) != 1:
        return fit
    ratio = measured.memory_factor(fixes[0], c.accelerator)
    if ratio is None:
        return fit
    plain = estimate_fit(traces.get(), c.accelerator, strategy, c.gpus, utilisation=utilisation)
    out = {**fit, **with_measured_peak(plain, fit, ratio, c.accelerator), "memory_source": MemorySource.MEASURED}
    why.append(f"memory: training x{ratio:.2f} of the configuration without it, as measured there, applied "
               f"(the trace predicted {fit['device_used_bytes'] / 2**30:.1f} GiB per device; evaluation as traced)")
    return out


def advise(spec, traces, acc: Accelerator, strategy: str, gpus: int, catalog: dict[str, Accelerator],
           utilisation: float | None = None, measured: MeasuredFixes | None = None) -> list[Advice]:
    """Combinations for ``spec`` on ``acc`` (as ``strategy`` over ``gpus``) in order of cost, up to and
    including the cheapest that fits (marked ``cheapest_that_fits``); all of them when none fits. ``measured``:
    what ``pilotrun variants`` measured for this config (:func:`.measured.measured_fixes`)."""
    current = estimate_fit(traces.get(), acc, strategy, gpus, utilisation=utilisation)
    base_s = current["seconds_per_update"]
    out = []
    for c in combinations(spec, acc, strategy, gpus, catalog):
        if c.smaller_micro_batch and not _micro_batches(spec):
            continue
        row = evaluate(spec, traces, c, strategy, base_s, utilisation, measured)
        out.append(row)
        if row.fits:
            row.cheapest_that_fits = True
            break
    return out
