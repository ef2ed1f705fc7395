"""What ``pilotrun variants`` measured for this job, for the advisor: the recompute cost and the memory saving of
activation checkpointing (and of the other fixes), measured instead of assumed where they apply.

A ratio measured on one device says nothing exact about another (a CPU's recompute cost is not an H100's): a
measurement is used for a target accelerator only when the variants ran on that accelerator (the catalog's name
matching, as a pilot's utilisation is), and is otherwise quoted beside the prediction, saying where it was measured.

Example::

    measured = measured_fixes(ledger, spec.pilot_hash())      # None: no variants run of this config
    use = measured.time_factor("checkpointing", acc)          # (1.31, "measured in RUN on NVIDIA H100 ...")
    peak = measured.memory_factor("checkpointing", acc)       # 0.58: applied to a one-device row alone
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..ledger.details import VariantDetails
from ..ledger.records import TRAINING_GATES, RunKind, Verdict
from ..ledger.store import Ledger
from .catalog import Accelerator, matches
from .lengths import DataLengths
from .model import estimate_fit


@dataclass(frozen=True)
class MeasuredFixes:
    fixes: dict[str, VariantDetails]          # variant name -> its newest compared row's details
    where: dict[str, tuple[str, str | None]]  # variant name -> (the run that measured it, the device it ran on)

    def time_factor(self, name: str, acc: Accelerator) -> tuple[float | None, str]:
        """The measured time ratio of fix ``name`` where it applies to ``acc`` (else None), and what to say."""
        d = self.fixes.get(name)
        if d is None or d.time_ratio is None:
            return None, ""
        run_id, device = self.where[name]
        said = f"measured in {run_id} on {device or 'an unrecorded device'}"
        if not matches(acc, device):
            return None, (f"x{d.time_ratio:.2f} time {said}; not applied to {acc.name}: another device "
                          "(run pilotrun variants there)")
        return d.time_ratio, f"x{d.time_ratio:.2f} time {said}"

    def memory_text(self, name: str) -> str:
        d = self.fixes.get(name)
        if d is None or d.peak_ratio is None:
            return ""
        return f"peak x{d.peak_ratio:.2f} of the control's live tensors, measured in {self.where[name][0]}"

    def memory_factor(self, name: str, acc: Accelerator) -> float | None:
        """The measured peak ratio of fix ``name`` where it applies to ``acc`` (the variants ran there), else None."""
        d = self.fixes.get(name)
        if d is None or d.peak_ratio is None or not matches(acc, self.where[name][1]):
            return None
        return d.peak_ratio


def with_measured_peak(plain: dict, fixed: dict, ratio: float, acc: Accelerator) -> dict:
    """The fix's row with the training stages measured: ``plain`` (estimate_fit of the job without the fix) x the
    measured peak ``ratio``, the library workspaces (each stage's ``workspace_bytes``) kept out of the ratio, the
    bytes saved taken off reserved and device memory with the reserved margin on them. The variants measured
    updates, not evaluation: the eval stage stays as ``fixed`` (the fix's own trace) has it, and the row is its worst
    stage."""
    margin = float(acc.defaults.get("reserved_margin", 0.10))
    stages = dict(fixed["stages"])
    for name in TRAINING_GATES:
        p = plain["stages"][name]
        alloc = (p["peak_allocated_bytes"] - p["workspace_bytes"]) * ratio + p["workspace_bytes"]
        saved = (p["peak_allocated_bytes"] - alloc) * (1 + margin)
        stages[name] = {**p, "peak_allocated_bytes": int(alloc), "measured_ratio": ratio,
                        "peak_reserved_bytes": int(p["peak_reserved_bytes"] - saved),
                        "device_used_bytes": int(p["device_used_bytes"] - saved)}
    worst = max(stages, key=lambda s: stages[s]["device_used_bytes"])
    return {"stages": stages, "limiting_stage": worst, "fits": stages[worst]["device_used_bytes"] <= acc.memory_bytes,
            **{k: stages[worst][k] for k in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")}}


def seconds_with_recompute(traces, acc: Accelerator, strategy: str, gpus: int, utilisation: float | None,
                           micro_scale: float, ratio: float, precision: str | None = None,
                           micro_batches: int | None = None, lengths: DataLengths | None = None) -> float | None:
    """A configuration's time per update with checkpointing as measured: the same configuration traced without
    checkpointing (at ``precision``, None: the spec's), timed as the estimate does, x the measured recompute
    ``ratio``. None where that time is unknown (no peak for the precision)."""
    plain = traces.get(ac=False, precision=precision)
    s = estimate_fit(plain, acc, strategy, gpus, utilisation=utilisation, micro_scale=micro_scale,
                     micro_batches=micro_batches, lengths=lengths)["seconds_per_update"]
    return s * ratio if s else None


def measured_fixes(ledger: Ledger | None, config_hash: str) -> MeasuredFixes | None:
    """What ``pilotrun variants`` runs of this config measured: for each variant, its row in the newest run that
    compared it (a failed or skipped variant measured nothing the advisor should use), so a later run of other
    variants does not hide an earlier measurement. None without one."""
    if ledger is None:
        return None
    ids = ledger.run_ids(RunKind.VARIANTS, config_hash)
    if not ids:
        return None
    fixes: dict[str, VariantDetails] = {}
    where: dict[str, tuple[str, str | None]] = {}
    for run_id in ids:  # newest first
        run = ledger.run(run_id) or {}
        meta = json.loads(run.get("meta_json") or "{}")
        for row in ledger.gate_records(run_id):
            d = VariantDetails.of(row.details)
            if d.variant and d.variant not in fixes and d.control_row is not None and row.verdict in (
                    Verdict.PASS, Verdict.WARN):
                fixes[d.variant] = d
                where[d.variant] = (run_id, meta.get("device_name") or meta.get("device"))
    return MeasuredFixes(fixes, where)
