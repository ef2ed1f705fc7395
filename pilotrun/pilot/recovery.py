"""``pilotrun run SPEC --task-id ID``: what a task that a scheduler may restart (SkyPilot's managed-job recovery runs
its ``run`` script again from the top on a new node) does with the pilot of this spec, decided from the ledger.

:func:`pilot_recovery` is a function from the ledger's run rows to a :class:`RecoveryPlan`; it starts nothing.
A task id is the same across the restarts of one task (``$SKYPILOT_TASK_ID``) and differs between two launches, so
a restart finds its own pilot and a new launch pilots again.

Example::

    task = "sky-2026-12-01-...-0"
    plan = pilot_recovery(ledger.task_runs(spec.name, RunKind.PILOT, task), task, spec.config_hash())
    if plan.action == Recovery.PROVEN: ...   # not run again
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..ledger.records import RESUMABLE, RunKind, RunStatus, TextEnum


class Recovery(TextEnum):
    """What a (re)started task does with its pilot."""

    START = "start"      # this task has no pilot of this spec yet: run it
    PROVEN = "proven"    # its pilot passed (or only warned): not run again, exit 0
    FAILED = "failed"    # its pilot failed a gate: the task stops again, exit 1 (a fix is a new launch)
    RESUME = "resume"    # its pilot was cut short (a signal, a killed node, an error): continue it (--resume)


@dataclass(frozen=True)
class RecoveryPlan:
    action: Recovery
    run_id: str | None
    reason: str


def task_of(run: dict) -> str | None:
    """The task id a run row recorded (``meta.task_id``), or None."""
    meta = run.get("meta")
    if meta is None:
        try:
            meta = json.loads(run.get("meta_json") or "{}")
        except ValueError:
            return None
    return meta.get("task_id") if isinstance(meta, dict) else None


def pilot_recovery(runs: list[dict], task_id: str, config_hash: str) -> RecoveryPlan:
    """From ``runs`` (newest first, as ``Ledger.task_runs`` lists them), what the task ``task_id`` does now."""
    mine = [r for r in runs if r["kind"] == RunKind.PILOT and task_of(r) == task_id]
    if not mine:
        return RecoveryPlan(Recovery.START, None, f"task {task_id} has no pilot of this spec in the ledger yet")
    last = mine[0]
    rid, status = last["run_id"], RunStatus(last["status"])
    if last.get("config_hash") != config_hash:
        return RecoveryPlan(Recovery.START, None, f"task {task_id}'s last pilot {rid} ran another config "
                                                  f"({str(last.get('config_hash'))[:8]}, now {config_hash[:8]})")
    if status in (RunStatus.PASS, RunStatus.WARN):
        return RecoveryPlan(Recovery.PROVEN, rid, f"task {task_id}'s pilot {rid} ended {status}: not run again")
    if status == RunStatus.FAIL:
        return RecoveryPlan(Recovery.FAILED, rid, f"task {task_id}'s pilot {rid} failed a gate "
                                                  f"(`pilotrun ledger --run {rid}`): the task stops again")
    if status in RESUMABLE:
        how = "was killed without recording its end" if status == RunStatus.RUNNING else f"ended {status}"
        return RecoveryPlan(Recovery.RESUME, rid, f"task {task_id}'s pilot {rid} {how}: continuing it (--resume)")
    return RecoveryPlan(Recovery.START, None, f"task {task_id}'s pilot {rid} ended {status}: running it again")
