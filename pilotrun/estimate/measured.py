"""What ``pilotrun variants`` measured for this job, for the advisor: the recompute cost and the memory saving of
activation checkpointing (and of the other fixes), measured instead of assumed where they apply.

A ratio measured on one device says nothing exact about another (a CPU's recompute cost is not an H100's): a
measurement is used for a target accelerator only when the variants ran on that accelerator (the catalog's name
matching, as a pilot's utilisation is), and is otherwise quoted beside the prediction, saying where it was measured.

Example::

    measured = measured_fixes(ledger, spec.config_hash())      # None: no variants run of this config
    use = measured.time_factor("checkpointing", acc)          # (1.31, "measured in RUN on NVIDIA H100 ...")
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..ledger.details import VariantDetails
from ..ledger.records import RunKind, Verdict
from ..ledger.store import Ledger
from .catalog import Accelerator, matches


@dataclass(frozen=True)
class MeasuredFixes:
    run_id: str
    device: str | None                  # what the variants ran on (the accelerator's name, or cpu)
    fixes: dict[str, VariantDetails]    # variant name -> its row's details (measured, not failed)

    def time_factor(self, name: str, acc: Accelerator) -> tuple[float | None, str]:
        """The measured time ratio of fix ``name`` where it applies to ``acc`` (else None), and what to say."""
        d = self.fixes.get(name)
        if d is None or d.time_ratio is None:
            return None, ""
        where = f"measured in {self.run_id} on {self.device or 'an unrecorded device'}"
        if not matches(acc, self.device):
            return None, (f"x{d.time_ratio:.2f} time {where}; not applied to {acc.name}: another device "
                          "(run pilotrun variants there)")
        return d.time_ratio, f"x{d.time_ratio:.2f} time {where}"

    def memory_text(self, name: str) -> str:
        d = self.fixes.get(name)
        if d is None or d.peak_ratio is None:
            return ""
        return f"peak x{d.peak_ratio:.2f} of the control's live tensors, measured in {self.run_id}"


def measured_fixes(ledger: Ledger | None, config_hash: str) -> MeasuredFixes | None:
    """The newest ``pilotrun variants`` run of this config in the ledger: its variants that ran and were compared
    (a failed variant measured nothing the advisor should use). None without one."""
    if ledger is None:
        return None
    ids = ledger.run_ids(RunKind.VARIANTS, config_hash)
    if not ids:
        return None
    run = ledger.run(ids[0]) or {}
    meta = json.loads(run.get("meta_json") or "{}")
    fixes = {}
    for row in ledger.gate_rows(ids[0]):
        d = VariantDetails.of(row.get("details"))
        if d.variant and d.variant != "control" and row.get("verdict") in (Verdict.PASS, Verdict.WARN):
            fixes[d.variant] = d
    return MeasuredFixes(ids[0], meta.get("device_name") or meta.get("device"), fixes)
