"""One campaign run of the user's program: its updates and validations become the run's series, pilotrun's stop rules
stop it, and its end is recorded as a run of pilotrun's loop is.

The program runs in the ``campaign`` role (:class:`~pilotrun.program.env.Role`) with its run's value and seed already
in its command and environment (:func:`pilotrun.campaign.spec.run_spec`). Every ``job.update`` becomes a point of
the ``train`` series and every ``job.evaluated`` a point of ``val`` (the callbacks report both), read from rank 0's
event file while the program runs and written in transactions. The stop rules (a non-finite loss, divergence) are
applied twice to the same losses: by the handle, whose ``should_stop`` is True from the update that broke one (the
program stops exactly there), and here, to record the run's end. The budget and Ctrl-C write the stop file
``should_stop`` reads too; a program that does not stop within :data:`STOP_GRACE_S` of either is killed with its
process tree. A diverged run keeps every point it wrote.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..ledger.records import RunEnd, RunStatus, Series, StopKind
from ..ledger.store import Ledger
from ..program.env import Event, Role, StopRules, UpdateRecord
from ..program.runner import EventTail, RunOutcome, RunPlan, kept_events, run_program
from .run_plan import CampaignRunPlan

if TYPE_CHECKING:
    from .runner import RunSink

# After the stop file, the program's own should_stop has this long to end the run. Well under the engines' own grace
# for the whole worker (engines/local.STOP_GRACE_S, the Ray engine's: 60 s), so the worker kills the program and still
# records the run's end, its checkpoint and the reason before its engine gives up on it.
STOP_GRACE_S = 30.0
FLUSH_EVERY_S = 2.0


def _number(value: Any) -> float | None:
    """A reported number (a non-finite one arrives as its text, "nan" or "inf")."""
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def train_point(u: UpdateRecord) -> dict:
    """An update as a point of the run's ``train`` series (the ledger's form)."""
    return {"step": u.update, "loss": _number(u.loss), "lr": _number(u.lr), "grad_norm": _number(u.grad_norm),
            "sample_ids": u.ids, "extra": u.extra}


class _Watch:
    """What rank 0 reported so far, the stop rules applied to it, and the run's end once one is decided."""

    def __init__(self, led, run_id: str, plan: CampaignRunPlan, rules: StopRules, deadline: float | None,
                 stop_requested: Callable[[], bool], how: Callable[[], str], stop_file: Path) -> None:
        self.led, self.run_id, self.plan, self.rules = led, run_id, plan, rules
        self.deadline, self.stop_requested, self.how, self.stop_file = deadline, stop_requested, how, stop_file
        self.pending: list[dict] = []
        self.flushed = time.monotonic()
        self.last_update = 0
        self.val: list[dict] = []
        self.saved: tuple[int, str] | None = None
        self.end: RunEnd | None = None
        self.asked: float | None = None

    def take(self, event: dict) -> None:
        kind = event.get("kind")
        if kind == Event.UPDATE:
            self._update(event)
        elif kind == Event.EVAL and isinstance(event.get("update"), int):
            loss = _number(event.get("loss"))
            metrics: dict = event["metrics"] if isinstance(event.get("metrics"), dict) else {}
            point = {"step": event["update"], "val_loss": loss, **metrics}
            self.val.append(point)
            self.flush()
            self.led.add_metrics(self.run_id, Series.VAL, [{"step": event["update"], "loss": loss,
                                                            "extra": {"accuracy": metrics.get("accuracy")}}])
        elif kind == Event.SAVED and isinstance(event.get("update"), int):
            self.saved = (event["update"], str(event.get("path")))

    def _update(self, event: dict) -> None:
        point = train_point(UpdateRecord.from_json(event))
        step, loss = point["step"], point["loss"]
        self.last_update = max(self.last_update, step)
        self.pending.append(point)
        if self.end is not None or loss is None:
            return
        broken = self.rules.broken(loss)  # the rules the handle applied to the same loss
        if broken is not None:
            said = event.get("loss") if broken is StopKind.NON_FINITE else loss
            self.end = RunEnd(RunStatus.DIVERGED, broken, self.rules.why(broken, said), step)

    def flush(self) -> None:
        self.flushed = time.monotonic()
        if self.pending:
            self.led.add_metrics(self.run_id, Series.TRAIN, self.pending)
            self.pending = []

    def poll(self, tail: EventTail) -> bool:
        """Read what is new, decide whether the run must stop; True: kill it now (it ignored the request)."""
        for event in tail.poll():
            self.take(event)
        if self.end is None and self.stop_requested():
            self.end = RunEnd(RunStatus.STOPPED, StopKind.INTERRUPTED, f"interrupted ({self.how()})",
                              self.last_update)
        elif self.end is None and self.deadline is not None and time.time() > self.deadline:
            self.end = RunEnd(RunStatus.STOPPED, StopKind.BUDGET, "budget: the campaign's time budget ran out",
                              self.last_update)
        if self.end is not None and self.asked is None:
            self.stop_file.parent.mkdir(parents=True, exist_ok=True)
            self.stop_file.write_text(self.end.reason or "")
            self.asked = time.monotonic()
        if time.monotonic() - self.flushed > FLUSH_EVERY_S:
            self.flush()
        return self.asked is not None and time.monotonic() - self.asked > STOP_GRACE_S

    def decide(self, outcome: RunOutcome) -> RunEnd:
        """The run's end from the stop rules and how the program ended."""
        if self.end is not None:
            if outcome.killed:  # on_poll asked for the kill: the program ignored should_stop
                return RunEnd(self.end.status, self.end.stop, f"{self.end.reason}; the program did not stop within "
                              f"{STOP_GRACE_S:g} s of the request (job.should_stop) and was killed", self.end.at)
            if self.end.at is not None and self.last_update > self.end.at:
                # Asked at the update the rule fired, the program stops at its next should_stop: those points are kept.
                return RunEnd(self.end.status, self.end.stop, f"{self.end.reason}; the program stopped after update "
                              f"{self.last_update}", self.end.at)
            return self.end
        updates = self.plan.updates
        if outcome.returncode != 0:
            return RunEnd(RunStatus.FAILED, StopKind.ERROR, f"the program {outcome.how_it_ended()}", self.last_update)
        if self.last_update < updates:
            return RunEnd(RunStatus.FAILED, StopKind.ERROR, (
                f"the program ended after update {self.last_update} of the campaign's {updates} (its own step count "
                "is lower: pass {updates} to it, e.g. program.args: [--max_steps, '{updates}'])"), self.last_update)
        return RunEnd(RunStatus.FINISHED)


# Beside a run's folder when it continues an interrupted run of the same variant and seed (followup.resume): the
# checkpoint the program reported last, the update it holds, and the interrupted run's first loss (the divergence
# rule's reference stays the run's first loss, not the first one after the resume).
CONTINUE_FILE = "continue.json"


def _events(run: dict) -> list[dict]:
    if not run.get("out_dir"):
        return []
    return kept_events(Path(run["out_dir"]), Role.CAMPAIGN)  # only the lines signed with that run's key


def last_checkpoint(run: dict) -> dict | None:
    """The last checkpoint a program's campaign run reported that still exists: {update, path}, from its row or, when
    its campaign was killed before recording its end, from its event file; for a run that continued another and
    saved nothing new, the checkpoint it continued from."""
    meta = run.get("meta") or {}
    found = (meta.get("checkpoint_update"), meta.get("checkpoint"))
    if not all(found):
        saved = [e for e in _events(run) if e.get("kind") == Event.SAVED]
        found = (saved[-1]["update"], saved[-1].get("path")) if saved else (None, None)
    update, path = found
    if isinstance(update, int) and isinstance(path, str) and Path(path).exists():
        return {"update": update, "path": path}
    before = meta.get("continues_from_checkpoint")
    if isinstance(before, dict) and isinstance(before.get("path"), str) and Path(before["path"]).exists():
        return {"update": before.get("update"), "path": before["path"]}
    return None


def first_loss(run: dict) -> float | None:
    """The run's first loss: its row's, or (a campaign killed before recording the run's end) its events' first."""
    recorded = (run.get("meta") or {}).get("first_loss")
    if isinstance(recorded, (int, float)):
        return float(recorded)
    losses = [_number(e.get("loss")) for e in _events(run) if e.get("kind") == Event.UPDATE]
    return next((x for x in losses if x is not None and math.isfinite(x)), None)


def _continuation(out_dir: Path) -> dict:
    try:
        data = json.loads((out_dir / CONTINUE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_program_run(spec, run_id: str, out_dir: Path, ledger_path: Path | None, plan: CampaignRunPlan,
                       deadline: float | None, stop_requested: Callable[[], bool], how: Callable[[], str],
                       sink: RunSink | None = None) -> dict:
    """:func:`program_run` recorded in the ledger at ``ledger_path``, or in ``sink`` (a Ray relay): what
    ``runner.train_run`` does for a program, callable without importing torch (this process only supervises)."""
    assert sink is not None or ledger_path is not None
    out_dir.mkdir(parents=True, exist_ok=True)
    with sink if sink is not None else Ledger(ledger_path) as led:
        return program_run(spec, run_id, out_dir, led, plan, deadline, stop_requested, how)


def program_run(spec, run_id: str, out_dir: Path, led, plan: CampaignRunPlan, deadline: float | None,
                stop_requested: Callable[[], bool], how: Callable[[], str]) -> dict:
    """Run the program once as this campaign run and record it in ``led`` (the ledger or a Ray relay)."""
    assert spec.program is not None
    base = out_dir / "program"
    stop_file = base / "stop-requested"
    stop_file.unlink(missing_ok=True)
    cont = _continuation(out_dir)
    first = cont.get("first_loss")  # a continued run keeps the interrupted run's first loss as the rule's reference
    rules = StopRules.declared(plan.stop, first)
    watch = _Watch(led, run_id, plan, rules, deadline, stop_requested, how, stop_file)
    run_plan = RunPlan(Role.CAMPAIGN, stop_at=plan.updates, stop_file=str(stop_file), stop_rules=rules,
                       timeout=math.inf, resume_from=cont.get("resume_from"), threads=plan.threads)
    tail = EventTail(base / "events" / f"{Role.CAMPAIGN}-rank0.jsonl", run_plan.key, rank=0)
    if isinstance(cont.get("after_update"), int):  # the updates before its checkpoint are the continued run's
        watch.last_update = cont["after_update"]
    outcome = run_program(spec.program, spec.folder, run_plan, out_dir, run_id, base / "ledger-of-the-program.sqlite",
                          on_poll=lambda: watch.poll(tail))
    for event in tail.poll():  # what it wrote after the last poll
        watch.take(event)
    watch.flush()
    for rank in outcome.ranks:  # the other ranks' points, from their own files (each rank reports its own ids)
        if rank:
            led.add_metrics(run_id, Series.TRAIN, [train_point(e) for e in outcome.updates(rank)], rank=rank)
    end = watch.decide(outcome)
    final = watch.val[-1] if watch.val else None
    kept: dict[str, Any] = {"program_log": str(outcome.log)}
    if plan.keep_checkpoint and watch.saved is not None:
        kept["checkpoint"] = watch.saved[1]  # the program's own, in its format: pilotrun never loads it
        kept["checkpoint_update"] = watch.saved[0]
    elif not plan.keep_checkpoint and end.status == RunStatus.FINISHED:
        # keep.checkpoint: false: the checkpoints written where pilotrun asked go once the run has its result (a run
        # cut short keeps them: --resume continues from them)
        shutil.rmtree(base / "checkpoints", ignore_errors=True)
    if end.status == RunStatus.FINISHED and final is None:
        kept["final_note"] = "the program reported no validation (job.evaluated, or the callbacks' eval)"
    led.finish_campaign_run(run_id, end, final=final, first_loss=rules.first_loss, **kept)
    result = {"run_id": run_id, "val": watch.val, "status": str(end.status), **end.fields(), "final": final,
              "first_loss": rules.first_loss, **kept}
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result
