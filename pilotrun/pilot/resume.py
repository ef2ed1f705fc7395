"""``pilotrun run --resume``: which interrupted pilot to continue, from which checkpoint, and which rows it keeps.

:func:`plan_resume` is a function from the ledger and the file system to a plan; it loads nothing
but manifests. Each of the parent's checkpoints, newest first, goes through the loading policy
(:class:`pilotrun.checkpoint.trust.LoadPolicy`: every file against its manifest, the manifest against
the ledger unless ``--trust``, never a pickle of an unknown folder) and must have been written for this
spec's config hash. The newest that passes is resumed; every one that does not is named file by file.
None usable is exit 2, never a silent fresh start. Which rows are carried is decided by the gates' own
declarations (``Gate.carry`` and ``Gate.recover``) in :func:`carry_rows`, once the context exists.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.io import recover_interrupted_swap
from ..checkpoint.trust import Admission, LoadPolicy, LoadRefused, Refusal, recorded_by
from ..gates.base import Gate
from ..gates.context import PilotContext
from ..gates.products import Product
from ..gates.registry import upstream_carried
from ..ledger.details import SaveDetails
from ..ledger.records import RESUMABLE, GateName, GateRow, RunKind, Verdict
from ..ledger.store import Ledger
from ..lock import diff_locks

__all__ = ["ProgramResumePlan", "ResumeError", "ResumePlan", "carry_rows", "plan_program_resume", "plan_resume"]


class ResumeError(Exception):
    """Nothing to resume, or a checkpoint that cannot be trusted: exit 2 with the reason."""


@dataclass
class ResumePlan:
    parent_id: str
    checkpoint: Path | None                                   # restore the driver from this after load
    rows: dict[str, GateRow] = field(default_factory=dict)    # the parent's rows that did not skip, by gate
    notes: list[str] = field(default_factory=list)
    manifest_sha256: str | None = None                        # of ``checkpoint``'s manifest


def _parent(ledger: Ledger, name: str, target: str | None) -> dict:
    if target and target != "latest":
        parent = ledger.run(target)
        if parent is None:
            raise ResumeError(f"no run {target!r} in {ledger.path}; see `pilotrun ledger --name {name}`")
        if parent["name"] != name:
            raise ResumeError(f"run {parent['run_id']} is of spec {parent['name']!r}, not {name!r}")
        return parent
    parent = next((r for r in ledger.runs(name, limit=200, kind=RunKind.PILOT) if r["status"] in RESUMABLE
                   and not ledger.children(r["run_id"])), None)
    if parent is None:
        raise ResumeError(f"no interrupted pilot named {name!r} in {ledger.path} (statuses "
                          f"{', '.join(str(s) for s in RESUMABLE)}, not resumed yet); give a run id to resume a "
                          "particular one")
    return parent


def _candidates(ledger: Ledger, parent: dict) -> list[Path]:
    """The parent's checkpoints, newest first: every ``step-*`` folder under its ``checkpoints/`` and every folder
    its save rows recorded (one that is gone is a candidate too, so it is named)."""
    root = Path(parent["out_dir"] or "") / "checkpoints"
    found = set()
    if root.is_dir():
        recover_interrupted_swap(root)
        # Not the fingerprints beside each folder (step-N.expect.json): a link there is not a checkpoint candidate.
        found |= {p for p in root.glob("step-*") if (p.is_dir() or p.is_symlink()) and ".expect" not in p.name}
    for row in ledger.gate_records(parent["run_id"]):
        path = SaveDetails.of(row.details).path
        if row.gate == GateName.SAVE and isinstance(path, str):
            found.add(root / Path(path).name)  # the row may hold a path relative to the run's working folder
    return sorted(found, key=lambda p: p.name, reverse=True)


def _whose(ledger: Ledger, config_hash: str) -> str:
    runs = recorded_by(ledger, config_hash=config_hash)
    if not runs:
        return "no run in this ledger"
    names = sorted({r["name"] for r in runs})
    return f"spec {', '.join(repr(n) for n in names)}, run {runs[0]['run_id']}"


def _admit(policy: LoadPolicy, ledger: Ledger, folder: Path, config_hash: str | None) -> Admission:
    if not folder.exists() and not folder.is_symlink():
        raise LoadRefused(Refusal.DAMAGED, f"{folder} is gone (the interrupted run's save row recorded it)",
                          [f"{folder} is gone"])
    adm = policy.admit(folder)
    written_for = adm.manifest.get("config_hash")
    if config_hash is not None and written_for != config_hash:
        whose = _whose(ledger, written_for) if isinstance(written_for, str) else "no config hash recorded"
        raise LoadRefused(Refusal.OTHER_CONFIG, (
            f"{folder} was written for config hash {str(written_for)[:12]}… ({whose}), not this spec's "
            f"{config_hash[:12]}…: another spec shares this --out folder; never resumed across configs"))
    return adm


def _refusal_lines(folder: Path, exc: LoadRefused) -> str:
    """One checkpoint's refusal: a damaged one file by file, one line each."""
    if exc.kind == Refusal.DAMAGED and exc.problems:
        return f"  - {folder} is damaged:\n" + "\n".join(f"      {p}" for p in exc.problems)
    return f"  - {exc}"


def _same_config(parent: dict, config: dict, config_hash: str) -> None:
    """ResumeError naming the keys that changed when this spec's config is not the interrupted pilot's."""
    if not parent.get("config_hash") or parent["config_hash"] == config_hash:
        return
    old = json.loads(parent["lock_json"]).get("config", {}) if parent.get("lock_json") else {}
    changed = [k for k, _, _ in diff_locks({"config": old}, {"config": config})] if old else []
    what = f": {', '.join(changed[:6])}" if changed else ""
    raise ResumeError(f"the spec changed since run {parent['run_id']}{what}; a resumed pilot must run the same config "
                      "(run without --resume to start a new pilot)")


def plan_resume(ledger: Ledger, name: str, target: str | None, trust: bool, config: dict | None = None,
                config_hash: str | None = None) -> ResumePlan:
    parent = _parent(ledger, name, target)
    pid = parent["run_id"]
    if config_hash is not None:
        _same_config(parent, config or {}, config_hash)
    candidates = _candidates(ledger, parent)
    if not candidates:
        return ResumePlan(pid, None, notes=[f"run {pid} was interrupted before its save gate wrote a checkpoint: "
                                            "the pilot starts over"])
    policy = LoadPolicy.from_ledger(ledger, trust)
    refused: list[tuple[Path, LoadRefused]] = []
    for folder in candidates:
        try:
            adm = _admit(policy, ledger, folder, config_hash)
        except LoadRefused as exc:
            refused.append((folder, exc))
            continue
        rows = {r.gate: r for r in ledger.gate_records(pid) if r.verdict != Verdict.SKIP}
        notes = [f"not resumed from {f.name}: " + _refusal_lines(f, exc).strip() for f, exc in refused]
        if refused:
            notes.append(f"{folder.name} is intact and usable: resuming from it (the newer checkpoint(s) above "
                         "are not loaded)")
        return ResumePlan(pid, folder, rows, notes, adm.manifest_sha256)
    lines = "\n".join(_refusal_lines(folder, exc) for folder, exc in refused)
    kinds = {exc.kind for _, exc in refused}
    fix = ("pass --trust to load an unrecorded checkpoint (still never unpickled), or run without --resume"
           if kinds == {Refusal.UNKNOWN} else "run without --resume to start a new pilot")
    raise ResumeError(f"run {pid} has no usable checkpoint ({len(refused)} checked, newest first; none is loaded):"
                      f"\n{lines}\n{fix}")


def carry_rows(plan: ResumePlan, gates: list[type[Gate]], ctx: PilotContext) -> dict[str, GateRow]:
    """The parent's rows this pilot keeps, by gate, with what each produced put back into ``ctx``.

    A row is carried when its gate allows it (``carry``), it did not skip, the gate can recover what it
    produced (``recover``), and every carryable gate whose products it reads was carried too — a kept
    row never rests on one measured again. Everything else runs again.
    """
    carried: dict[str, GateRow] = {}
    if plan.checkpoint is None:
        return carried
    for gate_cls in gates:
        row = plan.rows.get(gate_cls.name)
        if row is None or not gate_cls.carry:
            continue
        if Product.CHECKPOINT in gate_cls.produces and \
                SaveDetails.of(row.details).manifest_sha256 != plan.manifest_sha256:
            continue  # the row describes another checkpoint than the one resumed (an older one was usable)
        if any(up not in carried for up in upstream_carried(gate_cls)):
            continue
        if gate_cls().recover(ctx, row):
            carried[gate_cls.name] = row
    plan.notes.append(f"resuming run {plan.parent_id} from {plan.checkpoint} ({len(carried)} gate row(s) carried "
                      "over)")
    return carried


@dataclass
class ProgramResumePlan:
    """An interrupted program pilot continued: the runs of the program it finished, reused as they ended."""

    parent_id: str
    reused: dict = field(default_factory=dict)   # Role -> RunOutcome
    notes: list[str] = field(default_factory=list)


def _changed_program_files(parent: dict, spec) -> list[str]:
    """The program's files whose content differs from what the parent's lock hashed (added and removed too)."""
    from ..lock import program_lock

    try:
        old = (json.loads(parent["lock_json"]).get("program") or {}).get("files") if parent.get("lock_json") else None
    except ValueError:
        old = None
    if not isinstance(old, dict):
        return []
    new = program_lock(spec).get("files") or {}
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _ancestors(ledger: Ledger, run: dict, limit: int = 16) -> list[dict]:
    """The run and the pilots it resumed, newest first."""
    chain = [run]
    while len(chain) < limit and chain[-1].get("parent_id"):
        before = ledger.run(chain[-1]["parent_id"])
        if before is None or before.get("kind") != RunKind.PILOT:
            break
        chain.append(before)
    return chain


def plan_program_resume(ledger: Ledger, spec, target: str | None) -> ProgramResumePlan:
    """Which runs of an interrupted program pilot are kept: each one that ended as planned (the control and resumed
    runs cleanly, the interrupted run killed after its save, its checkpoint still there). The program, its command
    and its files must be those of the interrupted pilot: a changed one is a config change (ResumeError)."""
    from ..program.env import Event, Role
    from ..program.runner import finished_run

    parent = _parent(ledger, spec.name, target)
    pid = parent["run_id"]
    _same_config(parent, spec.canonical(), spec.config_hash())
    edited = _changed_program_files(parent, spec)
    if edited:
        raise ResumeError(f"the program changed since run {pid}: {', '.join(edited[:6])} differ from the files its "
                          "lock hashed; a resumed pilot must run the same program (run without --resume to pilot the "
                          "new one)")
    chain = _ancestors(ledger, parent)
    reused: dict = {}
    notes: list[str] = []
    for role in (Role.CONTROL, Role.STAGES, Role.INTERRUPTED, Role.RESUMED):
        # A run a resumed pilot kept is recorded where it ran: in the folder of the pilot before it.
        run = next((r for p in chain if (r := finished_run(Path(p["out_dir"] or ""), role, p["run_id"]))), None)
        if run is None:
            continue
        if role == Role.INTERRUPTED:
            saved = run.of(Event.SAVED, 0)
            if not (run.killed and not run.survivors and saved and Path(saved[-1]["path"]).exists()):
                notes.append(f"run {pid}'s interrupted run is run again: it "
                             + ("left no checkpoint that still exists" if run.killed else run.how_it_ended()))
                continue
        elif not run.ended_cleanly:
            notes.append(f"run {pid}'s {role} run is run again: it {run.how_it_ended()}")
            continue
        if role == Role.RESUMED and Role.INTERRUPTED not in reused:
            continue  # it resumed from a checkpoint this pilot does not keep
        reused[role] = run
    kept = ", ".join(f"{role} ({run.seconds:.1f} s)" for role, run in reused.items())
    notes.append(f"resuming program pilot {pid}: " + (f"its finished runs are kept as they ended: {kept}; the rest "
                                                      "run now" if reused else "none of its runs finished: all run "
                                                                               "again"))
    return ProgramResumePlan(pid, reused, notes)
