"""``pilotrun run --resume``: which interrupted pilot to continue, from which checkpoint, and which rows it keeps.

:func:`plan_resume` is a function from the ledger and the file system to a plan; it loads nothing
but manifests, and it refuses a checkpoint whose manifest the ledger never recorded unless the
user passes ``--trust``. Which rows are carried is decided by the gates' own declarations
(``Gate.carry`` and ``Gate.recover``) in :func:`carry_rows`, once the context exists.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.io import CheckpointError, latest_checkpoint
from ..checkpoint.state import check_trusted
from ..gates.base import Gate
from ..gates.context import PilotContext
from ..gates.registry import upstream_carried
from ..ledger.records import RESUMABLE, RunKind, Verdict
from ..ledger.store import Ledger
from ..lock import diff_locks


class ResumeError(Exception):
    """Nothing to resume, or a checkpoint that cannot be trusted: exit 2 with the reason."""


@dataclass
class ResumePlan:
    parent_id: str
    checkpoint: Path | None                                   # restore the driver from this after load
    rows: dict[str, dict] = field(default_factory=dict)       # the parent's rows that did not skip, by gate
    notes: list[str] = field(default_factory=list)


def known_manifests(ledger: Ledger, run_id: str | None = None) -> set[str]:
    """sha256 of every checkpoint manifest the ledger recorded (save rows)."""
    found = set()
    runs = [ledger.run(run_id)] if run_id else ledger.runs(limit=10_000)
    for run in runs:
        if run is None:
            continue
        for row in ledger.gate_rows(run["run_id"]):
            sha = (row.get("details") or {}).get("manifest_sha256")
            if sha:
                found.add(sha)
    return found


def _parent(ledger: Ledger, name: str, target: str | None) -> dict:
    if target and target != "latest":
        parent = ledger.run(target)
        if parent is None:
            raise ResumeError(f"no run {target!r} in {ledger.path}; see `pilotrun ledger --name {name}`")
        if parent["name"] != name:
            raise ResumeError(f"run {parent['run_id']} is of spec {parent['name']!r}, not {name!r}")
        return parent
    parent = next((r for r in ledger.runs(name, limit=200) if r["kind"] == RunKind.PILOT and r["status"] in RESUMABLE
                   and not ledger.children(r["run_id"])), None)
    if parent is None:
        raise ResumeError(f"no interrupted pilot named {name!r} in {ledger.path} (statuses "
                          f"{', '.join(str(s) for s in RESUMABLE)}, not resumed yet); give a run id to resume a "
                          "particular one")
    return parent


def plan_resume(ledger: Ledger, name: str, target: str | None, trust: bool, config: dict | None = None,
                config_hash: str | None = None) -> ResumePlan:
    parent = _parent(ledger, name, target)
    pid = parent["run_id"]
    if config_hash is not None and parent.get("config_hash") and parent["config_hash"] != config_hash:
        old = json.loads(parent["lock_json"]).get("config", {}) if parent.get("lock_json") else {}
        changed = [k for k, _, _ in diff_locks({"config": old}, {"config": config or {}})] if old else []
        what = f": {', '.join(changed[:6])}" if changed else ""
        raise ResumeError(f"the spec changed since run {pid}{what}; a resumed pilot must run the same config "
                          "(run without --resume to start a new pilot)")
    folder = latest_checkpoint(Path(parent["out_dir"] or "") / "checkpoints")
    if folder is None:
        return ResumePlan(pid, None, notes=[f"run {pid} left no complete checkpoint: the pilot starts over"])
    try:
        check_trusted(folder, known_manifests(ledger), trust)
    except CheckpointError as exc:
        raise ResumeError(str(exc)) from None
    rows = {r["gate"]: r for r in ledger.gate_rows(pid) if r["verdict"] != Verdict.SKIP}
    return ResumePlan(pid, folder, rows)


def carry_rows(plan: ResumePlan, gates: list[type[Gate]], ctx: PilotContext) -> dict[str, dict]:
    """The parent's rows this pilot keeps, by gate, with what each produced put back into ``ctx``.

    A row is carried when its gate allows it (``carry``), it did not skip, the gate can recover what it
    produced (``recover``), and every carryable gate whose products it reads was carried too — a kept
    row never rests on one measured again. Everything else runs again.
    """
    carried: dict[str, dict] = {}
    if plan.checkpoint is None:
        return carried
    for gate_cls in gates:
        row = plan.rows.get(gate_cls.name)
        if row is None or not gate_cls.carry:
            continue
        if any(up not in carried for up in upstream_carried(gate_cls)):
            continue
        if gate_cls().recover(ctx, row):
            carried[gate_cls.name] = row
    plan.notes.append(f"resuming run {plan.parent_id} from {plan.checkpoint} ({len(carried)} gate row(s) carried "
                      "over)")
    return carried
