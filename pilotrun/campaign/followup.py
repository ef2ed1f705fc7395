"""After a campaign: retry one run differently, or continue an interrupted campaign.

Both add new runs linked to the run they follow (``parent_id``); neither replaces a row. Both
rebuild the runs from the campaign and base *as stored in the ledger at the start*, so editing
the files afterwards cannot leak into a campaign that is already under way.

Example::

    retry("lr-sweep", "r05", ["train.micro_batch_size=4", "train.grad_accum_steps=4"], ledger)
    resume("lr-sweep", ledger, parallel=2)   # after Ctrl-C: the runs that did not finish, as new linked runs
"""
from __future__ import annotations

import difflib
import json
import re
import time
from datetime import datetime
from pathlib import Path

from ..config.load import parse_override, spec_from_mapping
from ..ledger.records import CUT_SHORT, RESULTS, RunEnd, RunKind, RunStatus, Series, StopKind, TextEnum
from ..ledger.store import Ledger
from ..procs import is_alive, process_mark
from . import kinds
from .conclude import attempts
from .engines.base import EngineChoice
from .orchestrate import (
    CampaignError,
    CampaignInterrupted,
    base_pilot,
    cluster_plan,
    engine_for,
    execute,
    finish,
    led_runs,
    parallel_plan,
    plan_run_row,
    record_lost_end,
    run_campaign,
    runs_folder,
)
from .run_plan import CampaignRunPlan
from .spec import RETRY_KEYS, campaign_from_stored, examples_per_update, load_campaign, run_size, run_spec


def _campaign(led: Ledger, campaign_ref: str, ledger_path: Path) -> dict:
    camp = led.run(campaign_ref)
    if camp is None or camp["kind"] != RunKind.CAMPAIGN:
        raise CampaignError(f"no campaign {campaign_ref!r} in {ledger_path}")
    return camp


def _run_root(camp: dict, cmeta: dict, engine: EngineChoice | None) -> Path:
    """Where a new run's folder goes: this command's --storage, else the campaign's (its row keeps it)."""
    if engine is not None and engine.storage is not None:
        return runs_folder(engine, camp["run_id"], Path(camp["out_dir"]))
    stored = (cmeta.get("engine") or {}).get("storage")
    if not stored:
        return Path(camp["out_dir"])
    # The campaign's storage as recorded (CAMPAIGN_ID included); made again if it was cleaned up meanwhile.
    return runs_folder(EngineChoice("ray", storage=Path(stored).parent), camp["run_id"], Path(camp["out_dir"]))


def _new_run(camp: dict, cmeta: dict, parent: dict, spec, ledger_path: Path, root: Path | None = None,
             **extra) -> dict:
    """A new row for ``parent``'s variant and seed, numbered after every run the campaign has."""
    pmeta = parent.get("meta") or json.loads(parent["meta_json"] or "{}")
    run_id = f"{camp['run_id']}-r{len(led_runs(ledger_path, camp['run_id'])) + 1:02d}"
    out = (root or Path(camp["out_dir"])) / run_id
    with Ledger(ledger_path) as led:
        plan_run_row(led, camp["run_id"], cmeta["key"], run_id, spec, out, pmeta, parent_id=parent["run_id"], **extra)
    return {"run_id": run_id, "out": out, "spec": spec}


def retry(campaign_ref: str, parent_ref: str, overrides: list[str], ledger_path: Path,
          engine: EngineChoice | None = None) -> dict:
    """A new run for a parent's variant and seed with some keys changed; linked, never a replacement."""
    with Ledger(ledger_path) as led:
        camp = _campaign(led, campaign_ref, ledger_path)
        # "r05" means this campaign's r05
        short = f"{camp['run_id']}-{parent_ref}" if re.fullmatch(r"r\d+", parent_ref) else parent_ref
        parent = led.run(short)
        if parent is None or json.loads(parent["meta_json"] or "{}").get("campaign_id") != camp["run_id"]:
            raise CampaignError(f"{parent_ref!r} is not a run of campaign {camp['run_id']}; its runs are "
                                f"{camp['run_id']}-r01, -r02, ... (`pilotrun ledger --run {camp['run_id']}`)")
        pmeta = json.loads(parent["meta_json"])
        cmeta = json.loads(camp["meta_json"])
    changes = [parse_override(o) for o in overrides]
    bad = [k for k, _ in changes if k not in RETRY_KEYS]
    if bad:
        hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, RETRY_KEYS, 1)) else k
                 for k in bad]
        raise CampaignError(f"a retry may change {', '.join(RETRY_KEYS)} (the experiment stays the same); "
                            f"{', '.join(hints)} would make it another experiment: add it as a campaign instead")
    if not changes and parent["status"] == RunStatus.FINISHED:
        raise CampaignError(f"{parent['run_id']} finished; an identical rerun would not count (each seed counts "
                            "once). A retry changes how it runs: --set train.micro_batch_size=... with "
                            "train.grad_accum_steps, train.activation_checkpointing or train.device")
    # The campaign and its base as declared at the start (stored in the ledger), not as the files read now.
    c = campaign_from_stored(cmeta["campaign"], camp["spec_path"])
    base_written = cmeta.get("base_written")
    before = run_spec(c, pmeta["variant"], pmeta["seed"], base_written=base_written)
    spec = run_spec(c, pmeta["variant"], pmeta["seed"], changes, base_written=base_written)
    if examples_per_update(spec) != examples_per_update(before):
        raise CampaignError(f"the retry changes the examples per update ({examples_per_update(before)} -> "
                            f"{examples_per_update(spec)}): change train.grad_accum_steps with the micro batch")
    with engine_for(engine, ledger_path) as eng:
        if eng is not None:
            cluster_plan(eng, 1, 1, spec, None, run_size(c, spec))
        r = _new_run(camp, cmeta, parent, spec, ledger_path, _run_root(camp, cmeta, engine), retry_of=parent["run_id"],
                     changes=dict(changes))
        execute([r], c, camp["run_id"], ledger_path, Path(camp["out_dir"]), CampaignRunPlan.of(c), None, 1, False,
                json.loads(camp["lock_json"]), None, eng)
    return finish(camp["run_id"], ledger_path, after=f"retry {r['run_id']} of {parent['run_id']}")


def cut_short(runs: list[dict]) -> list[dict]:
    """Per declared variant and seed with no result yet, its latest attempt, when that was stopped or not run.

    A pair that finished, diverged, failed or was refused has its answer (changing it is a ``--retry``).
    """
    return [tries[-1] for tries in attempts(runs).values()
            if not any(t["status"] in RESULTS for t in tries) and tries[-1]["status"] in CUT_SHORT]


def _record_a_killed_campaign(camp: dict, runs: list[dict], ledger_path: Path, task_id: str | None = None) -> None:
    """A campaign with no recorded end whose process is gone (SIGKILL, OOM killer, reboot): give every run
    left "running" or "planned" an end that says so, and end the campaign as interrupted.

    ``task_id``: the task restarting it (``recover``). A scheduler runs one copy of a task at a time (SkyPilot's
    managed jobs relaunch it only once its node is gone), so a process its campaign recorded on another host is gone
    with that host."""
    cid, cmeta = camp["run_id"], json.loads(camp["meta_json"] or "{}")
    orch = cmeta.get("orchestrator")
    alive = is_alive(orch)
    elsewhere = alive is None and task_id is not None and orch is not None and cmeta.get("task_id") == task_id
    if elsewhere:
        alive = False
    if alive is None:
        where = f" on {orch['host']}" if orch else ""
        raise CampaignError(f"{cid} has no recorded end and its process{where} cannot be checked from here: if it "
                            "still runs, wait for it or stop it with Ctrl-C (which records every run), then --resume")
    if alive:
        raise CampaignError(f"{cid} is still running (pid {orch['pid']}): wait for it, or stop it with Ctrl-C "
                            "(which records every run), then --resume")
    open_runs = [r for r in runs if r["status"] in (RunStatus.RUNNING, RunStatus.PLANNED)]
    live = [r for r in open_runs if is_alive(r["meta"].get("worker"))]
    if live:
        raise CampaignError(f"{cid}'s own process (pid {orch['pid']}) is gone but "
                            + ", ".join(f"{r['run_id']} (pid {r['meta']['worker']['pid']})" for r in live)
                            + " still train: let them finish, or stop them with kill -INT PID (each records "
                            "where it stopped), then --resume")
    killed = (f"the campaign's node ({orch['host']}) was lost: task {task_id} restarted on another machine"
              if elsewhere else f"the campaign's process (pid {orch['pid']}) was killed")
    with Ledger(ledger_path) as led:
        for r in open_runs:
            steps = [m["step"] for m in led.metrics(r["run_id"], Series.TRAIN)]
            if r["status"] == RunStatus.RUNNING:
                last = max(steps, default=0)
                led.finish_campaign_run(r["run_id"], RunEnd(RunStatus.STOPPED, StopKind.CAMPAIGN_KILLED,
                                                            f"{killed}; the last update this run recorded is {last}",
                                                            last))
            else:
                led.finish_campaign_run(r["run_id"], RunEnd(RunStatus.NOT_RUN, StopKind.CAMPAIGN_KILLED,
                                                            f"{killed} before this run started", 0))
        # When it died is unknown: count the budget up to the last thing it is known to have done.
        seen = [datetime.fromisoformat(r["ended_at"]).timestamp() for r in runs if r["ended_at"]]
        seen += [r["meta"]["worker"]["started"] for r in runs if r["meta"].get("worker")]
        start = datetime.fromisoformat(camp["started_at"]).timestamp()
        led.merge_meta(cid, {"budget_spent_s": max(seen, default=start) - start})
        led.add_note(cid, f"{killed} without recording its end (found by --resume): {len(open_runs)} run(s) it left "
                          "open were recorded as stopped or not run")
    finish(cid, ledger_path, interrupted=True, after="a killed campaign was found")


def _seconds(a: str, b: str | None) -> float:
    return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds() if b else 0.0


def resume(campaign_ref: str, ledger_path: Path, parallel: int | None = 1, allow_drift: bool = False,
           on_event=None, on_start=None, engine: EngineChoice | None = None) -> dict:
    """Continue an interrupted campaign: each run it stopped or never started runs again, from the start, as a new
    run linked to the one it continues (a program's run from the last checkpoint its program reported, which the
    pilot's resume gate proved it continues from exactly). The time budget is what the campaign had left."""
    with Ledger(ledger_path) as led:
        camp = _campaign(led, campaign_ref, ledger_path)
        runs = led.campaign_runs(camp["run_id"])
    cid, status = camp["run_id"], camp["status"]
    if status == RunStatus.RUNNING:
        _record_a_killed_campaign(camp, runs, ledger_path)  # or say why it cannot be resumed yet
        with Ledger(ledger_path) as led:
            camp, runs = led.run(cid) or camp, led.campaign_runs(cid)
        status = camp["status"]
    # A campaign that ended with runs whose Ray worker was lost continues them too: the loss was not theirs.
    lost = [r for r in cut_short(runs) if r["meta"].get("stop_kind") == StopKind.WORKER_LOST]
    if status != RunStatus.INTERRUPTED and not (status == RunStatus.FINISHED_WITH_STOPS and lost):
        raise CampaignError(f"{cid} was not interrupted (it ended {status}); --resume continues an interrupted "
                            f"campaign. To run one of its runs differently: --retry RUN --set KEY=VALUE")
    todo = cut_short(runs)
    if not todo:
        raise CampaignError(f"nothing to continue in {cid}: every declared run has a result (finished, diverged, "
                            "failed or refused); to run one differently: --retry RUN --set KEY=VALUE")
    cmeta = json.loads(camp["meta_json"])
    c = campaign_from_stored(cmeta["campaign"], camp["spec_path"])
    base_written = cmeta.get("base_written")
    spent = cmeta.get("budget_spent_s", _seconds(camp["started_at"], camp["ended_at"]))
    deadline = None
    if c.stop.budget_minutes:
        left = c.stop.budget_minutes * 60 - spent
        if left <= 0:
            raise CampaignError(f"{cid} has spent its budget ({spent / 60:.1f} of {c.stop.budget_minutes:g} minutes); "
                                "raise stop.budget_minutes in a new campaign to run more")
        deadline = time.time() + left
    specs = [run_spec(c, parent["meta"]["variant"], parent["meta"]["seed"], base_written=base_written)
             for parent in todo]
    base_hash = spec_from_mapping(base_written, c.folder / c.base).config_hash() if base_written else None
    with engine_for(engine, ledger_path) as eng:
        if eng is None:
            at_once = parallel_plan(c, specs[0], parallel or 1, ledger_path, base_hash=base_hash)
        else:
            at_once = cluster_plan(eng, parallel, len(specs), specs[0], base_pilot(c, ledger_path, base_hash),
                                   run_size(c, specs[0]))
        at_once["warnings"] = (cmeta.get("parallel") or {}).get("warnings", [])  # said at the start; said again
        plan = CampaignRunPlan.of(c).with_threads(at_once["threads_per_run"])
        with Ledger(ledger_path) as led:  # two resumes at once would run every seed twice: the first one wins
            # With the status, the mark of the process that runs it now: in one transaction, so another resume
            # never sees "running" under the old, dead process and takes it for a killed campaign.
            if not led.claim(cid, RunStatus(status), RunStatus.RUNNING, {"orchestrator": process_mark()}):
                raise CampaignError(f"{cid} is being resumed by another pilotrun process")
        began, new = time.time(), []
        root = _run_root(camp, cmeta, engine)
        try:
            for parent, spec in zip(todo, specs):
                cont = _program_continuation(c, parent)
                new.append(_new_run(camp, cmeta, parent, spec, ledger_path, root, continues=parent["run_id"], **cont))
                _write_continuation(new[-1]["out"], cont.get("continues_from_checkpoint"))
            if on_start:
                on_start(cid, at_once)
            execute(new, c, cid, ledger_path, Path(camp["out_dir"]), plan, deadline, at_once["parallel"], allow_drift,
                    json.loads(camp["lock_json"]), on_event, eng,
                    devices=at_once.get("devices"))
        except CampaignInterrupted:
            raise
        except BaseException:  # leave it resumable, not "running" for ever, and every new row with an end
            for r in new:
                record_lost_end(r, ledger_path, True, False)
            finish(cid, ledger_path, interrupted=True)
            raise
        finally:
            with Ledger(ledger_path) as led:
                led.merge_meta(cid, {"budget_spent_s": spent + time.time() - began})
    return finish(cid, ledger_path, after=f"resume ({len(new)} run(s) continued)")


def _program_continuation(c, parent: dict) -> dict:
    """For a program's run: the checkpoint its program reported last, to continue from (kept in the new run's meta);
    nothing for pilotrun's loop, whose runs start again."""
    if not kinds.of(c).continues_from_checkpoint:
        return {}
    from .program_run import first_loss, last_checkpoint

    found = last_checkpoint(parent)
    if found is None:
        return {"continues_from_checkpoint": None}
    return {"continues_from_checkpoint": {**found, "run_id": parent["run_id"], "first_loss": first_loss(parent)}}


def _write_continuation(out: Path, found: dict | None) -> None:
    """The continuation a program's run reads in its folder (program_run.CONTINUE_FILE)."""
    from .program_run import CONTINUE_FILE

    if found:
        (out / CONTINUE_FILE).write_text(json.dumps({"resume_from": found["path"], "after_update": found["update"],
                                                     "first_loss": found.get("first_loss"),
                                                     "from_run": found["run_id"]}))


class Continuation(TextEnum):
    """What ``pilotrun campaign FILE --task-id ID`` did: a task's first start, or a restart of it."""

    STARTED = "started"   # no campaign of this task in the ledger: started from the file
    RESUMED = "resumed"   # its campaign was cut short (a preempted node, a signal): continued with --resume
    ENDED = "ended"       # its campaign has ended with every run's result: nothing to run (exit 0, or 1 while a
    # failed run has no answer: cli/campaign.py)


def task_campaign(led: Ledger, name: str, task_id: str) -> dict | None:
    """The newest campaign of this name that ``task_id`` started (``meta.task_id``), or None: found by an indexed
    query, not among the newest rows of the name (the campaign's own runs carry its base's name and outnumber it)."""
    found = led.task_runs(name, RunKind.CAMPAIGN, task_id)
    return found[0] if found else None


def recover(path: Path, task_id: str, ledger_path: Path, out_root: Path, parallel: int | None = 1,
            allow_drift: bool = False, on_event=None, on_start=None,
            engine: EngineChoice | None = None) -> tuple[Continuation, str, dict]:
    """Start the campaign in ``path`` for the task ``task_id``, or, when this ledger already has the campaign that
    task started, continue it: safe to call again after any interruption, as a task a scheduler restarts runs its
    commands again. Every declared run is kept once: a run the interruption cut short stays as it was recorded
    (stopped, not run) and continues as a new run linked to it (``resume``); runs with a result are left as they
    are. (continuation, what happened in words, the result as ``run_campaign`` returns it)."""
    c = load_campaign(path)
    name = c.name or Path(path).stem
    camp = None
    if Path(ledger_path).exists():
        with Ledger(ledger_path) as led:
            camp = task_campaign(led, name, task_id)
    if camp is None:
        result = run_campaign(path, ledger_path, out_root, parallel, allow_drift, on_event, on_start, engine,
                              task_id=task_id)
        return Continuation.STARTED, f"task {task_id} started campaign {result['campaign_id']}", result
    cid = camp["run_id"]
    if camp["status"] == RunStatus.RUNNING:
        with Ledger(ledger_path) as led:
            runs = led.campaign_runs(cid)
        _record_a_killed_campaign(camp, runs, ledger_path, task_id)  # or say why it cannot be continued yet
    with Ledger(ledger_path) as led:
        camp, runs = led.run(cid) or camp, led.campaign_runs(cid)
    todo = cut_short(runs)
    lost = [r for r in todo if r["meta"].get("stop_kind") == StopKind.WORKER_LOST]
    if todo and (camp["status"] == RunStatus.INTERRUPTED or (camp["status"] == RunStatus.FINISHED_WITH_STOPS and lost)):
        result = resume(cid, ledger_path, parallel, allow_drift, on_event, on_start, engine)
        return Continuation.RESUMED, (f"task {task_id}'s campaign {cid} was cut short: continued its {len(todo)} "
                                      "stopped or not-run run(s) as new linked runs"), result
    if camp["status"] == RunStatus.INTERRUPTED:  # stopped after its last run's result, before its own end
        finish(cid, ledger_path, after="a restart found every run with a result")
    with Ledger(ledger_path) as led:
        camp = led.run(cid) or camp
    cmeta = json.loads(camp["meta_json"] or "{}")
    result = {"campaign_id": cid, "runs": runs, "conclusion": cmeta.get("conclusion"),
              "parallel": cmeta.get("parallel")}
    return Continuation.ENDED, f"task {task_id}'s campaign {cid} has ended ({camp['status']}): nothing to run", result
