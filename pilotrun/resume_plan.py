"""``pilotrun run --resume``: which interrupted pilot to continue, from which checkpoint, and what it already proved.

A function from the ledger and the file system to a plan; it loads nothing but
manifests, and it refuses a checkpoint whose manifest the ledger never recorded
unless the user passes ``--trust``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint.io import CheckpointError, latest_checkpoint
from .checkpoint.state import check_trusted, manifest_sha256
from .ledger.store import Ledger
from .lock import diff_locks

INTERRUPTED = ("running", "interrupted", "error")
# Gates whose rows a resumed pilot keeps instead of re-running (lock and load always run again:
# lock to compare the environment, load to rebuild the objects the checkpoint is restored into).
CARRYABLE = ("inspect", "split", "batch", "first_step", "steady_step", "accum_equivalence", "eval", "save", "export",
             "restore", "resume", "overfit")


class ResumeError(Exception):
    """Nothing to resume, or a checkpoint that cannot be trusted: exit 2 with the reason."""


@dataclass
class ResumePlan:
    parent_id: str
    checkpoint: Path | None
    carried: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    expect: Path | None = None
    manifest: str | None = None
    export_dir: Path | None = None
    scan: dict | None = None


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


def plan_resume(ledger: Ledger, name: str, target: str | None, trust: bool, config: dict | None = None,
                config_hash: str | None = None) -> ResumePlan:
    if target and target != "latest":
        parent = ledger.run(target)
        if parent is None:
            raise ResumeError(f"no run {target!r} in {ledger.path}; see `pilotrun ledger --name {name}`")
        if parent["name"] != name:
            raise ResumeError(f"run {parent['run_id']} is of spec {parent['name']!r}, not {name!r}")
    else:
        parent = next((r for r in ledger.runs(name, limit=200) if r["kind"] == "pilot" and r["status"] in INTERRUPTED
                       and not ledger.children(r["run_id"])), None)
        if parent is None:
            raise ResumeError(f"no interrupted pilot named {name!r} in {ledger.path} (statuses {', '.join(INTERRUPTED)}, "
                              "not resumed yet); give a run id to resume a particular one")
    pid = parent["run_id"]
    if config_hash is not None and parent.get("config_hash") and parent["config_hash"] != config_hash:
        old = json.loads(parent["lock_json"]).get("config", {}) if parent.get("lock_json") else {}
        changed = [k for k, _, _ in diff_locks({"config": old}, {"config": config or {}})] if old else []
        what = f": {', '.join(changed[:6])}" if changed else ""
        raise ResumeError(f"the spec changed since run {pid}{what}; a resumed pilot must run the same config "
                          "(run without --resume to start a new pilot)")
    rows = {r["gate"]: r for r in ledger.gate_rows(pid) if r["verdict"] != "skip"}
    folder = latest_checkpoint(Path(parent["out_dir"] or "") / "checkpoints")
    if folder is None:
        return ResumePlan(pid, None, notes=[f"run {pid} left no complete checkpoint: the pilot starts over"])
    try:
        check_trusted(folder, known_manifests(ledger), trust)
    except CheckpointError as exc:
        raise ResumeError(str(exc)) from None
    plan = ResumePlan(pid, folder, manifest=manifest_sha256(folder))
    expect = folder.parent / f"{folder.name}.expect.json"
    plan.expect = expect if expect.exists() else None
    for gate in CARRYABLE:
        if gate in rows:
            plan.carried[gate] = rows[gate]
    if "save" in plan.carried and plan.expect is None:
        plan.carried.pop("save")  # without the expectation file the restore gate needs a fresh save
    export = (rows.get("export") or {}).get("details", {}).get("path")
    if "export" in plan.carried and export and Path(export).exists():
        plan.export_dir = Path(export)
    else:
        plan.carried.pop("export", None)
    scan = (rows.get("inspect") or {}).get("details", {}).get("scan")
    if scan is None:
        for g in ("inspect", "batch"):
            plan.carried.pop(g, None)
    plan.scan = scan
    plan.notes.append(f"resuming run {pid} from {folder} ({len(plan.carried)} gate row(s) carried over)")
    return plan
