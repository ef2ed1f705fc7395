"""Run a campaign: every planned run gets an id up front, runs execute in worker processes (in parallel
when asked), the lock is checked before each, and nothing is ever replaced — a retry is a new run
linked to its parent.

Example::

    result = run_campaign(Path("examples/campaign/lr-sweep.yaml"), Path("runs/ledger.sqlite"), Path("runs"))
    print(result["conclusion"]["text"])
"""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from .. import strategies
from ..config.load import load_spec
from ..config.schema import SpecError
from ..config.spec import canonical_sha256
from ..devices import query_devices, query_host
from ..interrupt import Interrupted, as_interrupted, interruptible
from ..ledger.records import RunEnd, RunKind, RunStatus, StopKind, new_run_id
from ..ledger.store import Ledger
from ..lock import collect_lock, diff_locks
from ..procs import process_mark
from . import kinds
from .conclude import conclude, current
from .devices import DeviceMode, assign_devices
from .engines.base import ClusterEngine, Engine, EngineChoice, EngineRefusal
from .engines.local import LocalEngine
from .resources import PerRun, pilot_memory, plan_parallel
from .run_plan import CampaignRunPlan
from .spec import (
    CampaignSpec,
    base_spec,
    check_only_varied,
    examples_per_update,
    load_campaign,
    run_device,
    run_processes,
    run_size,
    run_spec,
    with_seed,
)
from .stops import interrupted

# What the lock compares between runs: the environment and inputs, not the config (which varies on purpose).
ENV_FIELDS = ("versions.", "distributions.", "container.", "model.", "data.", "code.commit")


class CampaignError(Exception):
    """The campaign cannot run as declared: the message names the key or run and the fix."""


class CampaignInterrupted(Interrupted):
    """Ctrl-C, SIGTERM or SIGHUP (``signum``, ``exit_code``): every run is recorded (stopped where it was, or not
    run) and the campaign ended; ``result`` says so."""

    def __init__(self, result: dict, signum: int = signal.SIGINT) -> None:
        super().__init__(signum)
        self.result = result


def _env_drift(a: dict, b: dict) -> list[str]:
    # Seeds differ between runs on purpose (they are listed in the campaign), so seed fields are not drift.
    return [k for k, _, _ in diff_locks(a, b) if k.startswith(ENV_FIELDS) and "seed" not in k]


NOT_STARTED = RunEnd(RunStatus.NOT_RUN, StopKind.INTERRUPTED, "the campaign was interrupted before this run started", 0)
def prepare(c: CampaignSpec, base_written: dict | None = None) -> tuple[list[dict], list[str]]:
    """Every planned run's spec, in order (control first); refuses variants that change another key.

    Linear in the runs, the base read once (``base_written``, else read here): each value's spec is built and
    checked once (the control's with its data and tokenizer files, which no variant may change); each further seed
    of pilotrun's own loop is that spec with the seed set (``with_seed``); a program's run is built per seed, as its
    templates put the seed in its command."""
    written = base_written if base_written is not None else base_spec(c).written
    runs: list[dict] = []
    problems: list[str] = []
    controls: dict = {}
    for i, value in enumerate(c.values):
        built, canonical = None, {}
        for seed in c.seeds:
            if built is not None and kinds.of(c).seeds_share_spec:
                spec = with_seed(built, seed)  # only the seed differs from the spec checked for this value
                config_hash = canonical_sha256({**canonical, "seed": seed})  # what spec.config_hash() computes
            else:
                spec = built = _checked_spec(c, value, seed, written, check_files=not runs)
                canonical = spec.canonical()
                config_hash = canonical_sha256(canonical)
                if i == 0:
                    controls[seed] = spec
                else:
                    problems += _variant_problems(c, value, controls.get(seed) or controls[c.seeds[0]], spec)
            runs.append({"variant": value, "variant_index": i, "seed": seed, "control": i == 0, "spec": spec,
                         "config_hash": config_hash})
    return runs, list(dict.fromkeys(problems))  # once per value, not once per seed


def _checked_spec(c: CampaignSpec, value, seed: int, written: dict, check_files: bool):
    """One run's spec; a CampaignError naming the value (or the key) when it is not a valid spec."""
    try:
        spec = run_spec(c, value, seed, base_written=written, check_files=check_files)
    except SpecError as exc:
        msgs = "; ".join(f"{f}: {m}" if f else m for f, m in exc.problems)
        if any(f == c.key for f, _ in exc.problems):
            raise CampaignError(f"vary: {c.key} is not a valid key of the base spec ({msgs})") from None
        raise CampaignError(f"{c.key} = {value!r} does not give a valid spec: {msgs}") from None
    if c.ranks > 1 and not strategies.get(spec.distributed.strategy).multi_process:
        key = "gpus_per_run" if c.gpus_per_run else "processes"
        raise CampaignError(f"{key}: {c.ranks} runs each run as a group of {c.ranks} processes, "
                            f"but the base's distributed.strategy is {spec.distributed.strategy}: set it to "
                            f"{' or '.join(strategies.multi_process_names())}")
    return spec


def _variant_problems(c: CampaignSpec, value, control, spec) -> list[str]:
    """What a variant's spec changes besides the varied key: another key, or the examples per update."""
    problems = []
    # A program's runs differ in the words and variables the templates filled in, by construction.
    moved = check_only_varied(control, spec, kinds.of(c).varied(c.key))
    if moved:
        problems.append(f"{c.key} = {value!r} would also change {', '.join(moved)}")
    if examples_per_update(spec) != examples_per_update(control):
        problems.append(f"{c.key} = {value!r} changes the examples per update "
                        f"({examples_per_update(control)} -> {examples_per_update(spec)})")
    return problems


def _accelerator(spec) -> tuple[str, int] | None:
    """The accelerator the runs will share (name, memory), or None when they run on the CPU."""
    inv = query_devices()
    device = run_device(spec)
    if device == "cpu" or not inv.runtime.indexed or not inv.count:
        return None
    index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
    return (inv.names[index], inv.total_memory_bytes[index]) if index < inv.count else None


def parallel_plan(c: CampaignSpec, control_spec, requested: int, ledger_path: Path,
                  base_hash: str | None = None) -> dict:
    """How many runs at once, from this machine and a pilot of the base spec in the ledger (see resources.py).

    ``base_hash``: the base spec's config hash when it is not the file on disk (a resume uses the stored base)."""
    with Ledger(ledger_path) as led:
        per_run = pilot_memory(led, base_hash or load_spec(c.folder / c.base, allow_program=True).config_hash())
    host = query_host()
    # One device per process of a run when several are visible: pilotrun's loop runs gpus_per_run ranks per run, a
    # program as many as its launcher starts (`torchrun --nproc-per-node 2 train.py`: two devices per run).
    processes = run_size(c, control_spec)
    devices = assign_devices(query_devices(), run_device(control_spec), per_run=processes, environ=os.environ)
    if devices.mode == DeviceMode.PER_RUN and not devices.slots:
        fewer = "program.command" if run_processes(control_spec) > 1 else "gpus_per_run"  # where the count is said
        raise CampaignError(f"each run starts {processes} processes, one device each: {devices.reason}; start fewer "
                            f"per run ({fewer}), or make more devices visible")
    return plan_parallel(requested, cpus=host.cpus, host_available_bytes=host.memory_available_bytes,
                         accelerator=_accelerator(control_spec), per_run=per_run, devices=devices,
                         processes=processes)


def warnings_for(c: CampaignSpec, runs: list[dict]) -> list[str]:
    """What runs but will not measure what it seems to: said before the start and kept on the campaign's row."""
    out: list[str] = []
    if not kinds.of(c).spec_schedule:  # a program's schedule is its own
        return out
    for r in runs:
        w = r["spec"].train.scheduler.warmup_updates
        if w >= c.updates:
            out.append(f"{c.key} = {r['variant']!r}: the warm-up ({w} updates) is not over by the campaign's "
                       f"{c.updates} updates, so the peak learning rate is never reached; the runs compare warm-ups")
    return list(dict.fromkeys(out))


def run_row(campaign_id: str, key: str, run_id: str, spec, out: Path, of: dict, parent_id: str | None = None,
            **extra) -> dict:
    """A campaign run's planned row (``Ledger.plan_runs``); ``out``: its folder, resolved. Variant, seed and control
    come from ``of``: the planned run (with its ``config_hash`` when prepare knew it), or the run that a retry or a
    resume follows."""
    return {"run_id": run_id, "name": spec.name, "kind": RunKind.CAMPAIGN_RUN, "spec_path": spec.source,
            "out_dir": str(out), "config_hash": of.get("config_hash") or spec.config_hash(), "parent_id": parent_id,
            "meta": {"campaign_id": campaign_id, "key": key,
                     **{k: of[k] for k in ("variant", "variant_index", "seed", "control")}, **extra}}


def plan_run_row(led: Ledger, campaign_id: str, key: str, run_id: str, spec, out: Path, of: dict,
                 parent_id: str | None = None, **extra) -> None:
    """A campaign run's folder and its ledger row, planned (a retry or a resume: one run)."""
    out.mkdir()
    led.plan_runs([run_row(campaign_id, key, run_id, spec, out.resolve(), {**of, "config_hash": None}, parent_id,
                           **extra)])


def run_campaign(path: Path, ledger_path: Path, out_root: Path, parallel: int | None = 1, allow_drift: bool = False,
                 on_event=None, on_start=None, engine: EngineChoice | None = None, task_id: str | None = None) -> dict:
    """Run every planned run; ``on_start(campaign_id, parallel_plan)`` and ``on_event(run_row)`` report progress.

    ``engine``: where the runs go (engines/base.py); None or "local": worker processes on this machine.
    ``parallel`` None: as many as the engine fits (Ray: the cluster's resources; local: one).
    ``task_id``: the task that runs it, kept on the campaign's row so a restart of that task finds it
    (``followup.recover``)."""
    c = load_campaign(path)
    name = c.name or Path(path).stem
    base = base_spec(c)  # read once: every run's spec, the pilot lookup and the campaign's row use this reading
    runs, problems = prepare(c, base.written)
    if problems:
        raise CampaignError("refused before the start: " + "; ".join(problems) + " (a campaign varies one key only)")
    with engine_for(engine, ledger_path) as eng:
        campaign_id = new_run_id(name)
        folder = out_root / campaign_id
        folder.mkdir(parents=True, exist_ok=True)
        run_root = runs_folder(engine, campaign_id, folder)
        control_lock = collect_lock(runs[0]["spec"])
        (folder / "campaign.json").write_text(json.dumps(c.canonical(), indent=1))
        (folder / "lock.json").write_text(json.dumps(control_lock, indent=1, sort_keys=True))
        if eng is None:
            at_once = parallel_plan(c, runs[0]["spec"], parallel or 1, ledger_path, base.config_hash())
        else:
            at_once = cluster_plan(eng, parallel, len(runs), runs[0]["spec"],
                                   base_pilot(c, ledger_path, base.config_hash()), run_size(c, runs[0]["spec"]))
        at_once["warnings"] = warnings_for(c, runs)
        plan = CampaignRunPlan.of(c).with_threads(at_once["threads_per_run"])
        (folder / "plan.json").write_text(json.dumps(plan.to_json(), indent=1))
        deadline = time.time() + c.stop.budget_minutes * 60 if c.stop.budget_minutes else None
        with Ledger(ledger_path) as led:
            led.start_run(campaign_id, name, RunKind.CAMPAIGN, spec_path=str(Path(path).resolve()),
                          out_dir=str(folder.resolve()), config_hash=c.digest(), lock=control_lock,
                          meta={"campaign": c.canonical(), "key": c.key, "values": c.values, "seeds": c.seeds,
                                "base": str((c.folder / c.base).resolve()), "parallel": at_once,
                                "orchestrator": process_mark(), "engine": engine_meta(engine, run_root),
                                "base_written": base.written, **({"task_id": task_id} if task_id else {})})
            root = run_root.resolve()
            for i, r in enumerate(runs):
                r["run_id"] = f"{campaign_id}-r{i + 1:02d}"
                r["out"] = root / r["run_id"]
                r["out"].mkdir()
            # One transaction for every declared run: the plan is in the ledger whole, or not at all.
            led.plan_runs([run_row(campaign_id, c.key, r["run_id"], r["spec"], r["out"], r) for r in runs])
        if on_start:
            on_start(campaign_id, at_once)
        execute(runs, c, campaign_id, ledger_path, folder, plan, deadline, at_once["parallel"], allow_drift,
                control_lock, on_event, eng, devices=at_once.get("devices"))
    return finish(campaign_id, ledger_path)


def base_pilot(c: CampaignSpec, ledger_path: Path, base_hash: str | None = None) -> PerRun | None:
    """What one run needed in a pilot of the base spec (resources.py), or None when no pilot measured it."""
    with Ledger(ledger_path) as led:
        return pilot_memory(led, base_hash or load_spec(c.folder / c.base, allow_program=True).config_hash())


def runs_folder(engine: EngineChoice | None, campaign_id: str, folder: Path) -> Path:
    """Where the runs' folders go: ``--storage``/CAMPAIGN_ID when given, else the campaign's own folder."""
    if engine is None or engine.storage is None:
        return folder
    root = engine.storage.resolve() / campaign_id
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CampaignError(f"--storage {engine.storage}: cannot create {root} ({exc.strerror}); give a folder this "
                            "machine can write (on a cluster, a shared filesystem every node mounts there)") from None
    return root


def engine_meta(engine: EngineChoice | None, run_root: Path) -> dict:
    """What the campaign's row keeps about the engine: which, where (address), and where the runs' files are."""
    e = engine or EngineChoice()
    return {"name": e.name, "address": e.address, "storage": str(run_root.resolve()),
            **({"nodes": e.nodes.group.to_dict()} if e.nodes is not None else {})}


def cluster_plan(eng: ClusterEngine, requested: int | None, runs: int, spec, per_run: PerRun | None,
                 processes: int) -> dict:
    """The engine's own plan (how many at once, what each asks for); its refusal as a CampaignError. ``processes``:
    the run's size (``run_size``); a program whose launcher starts several processes (run_processes) asks for a CPU,
    and a GPU, per process as a group does."""
    try:
        return eng.plan(requested, runs, spec, per_run, max(processes, run_processes(spec)))
    except EngineRefusal as exc:
        raise CampaignError(str(exc)) from None


@contextmanager
def engine_for(engine: EngineChoice | None, ledger_path: Path) -> Iterator[ClusterEngine | None]:
    """The engine to hand ``execute``, started for the block (None: the local engine, made by ``execute``)."""
    if engine is not None and engine.nodes is not None:  # every run spans the nodes: node 0's local engine
        from .engines.nodes import NodesEngine

        yield NodesEngine(engine.nodes)
        return
    if engine is None or engine.name == "local":
        yield None
        return
    try:
        from .engines.ray import RayEngine
    except ImportError as exc:
        raise CampaignError(f"--engine ray needs Ray ({exc}): pip install -e '.[ray]' (or pip install "
                            "'ray[default]')") from None
    try:
        eng = RayEngine(engine, ledger_path).__enter__()
    except ConnectionError as exc:
        raise CampaignError(f"--address {engine.address}: no Ray cluster answered ({exc}); start one with "
                            "`ray start --head` there, or leave out --address for a local Ray instance") from None
    try:
        yield eng
    finally:
        eng.__exit__(None, None, None)


# Ctrl-C, SIGTERM (timeout, schedulers, preemption) and SIGHUP (a closed SSH session) all stop the campaign
# cleanly, even when started with SIGINT ignored (a shell script's background job): no run is left "running".
@interruptible()
def execute(runs, c, campaign_id, ledger_path, folder, plan, deadline, parallel, allow_drift, control_lock, on_event,
            engine: Engine | None = None, devices: dict | None = None):
    """Run every planned run; on Ctrl-C or SIGTERM, stop the running ones where they are and start no more.

    ``engine`` runs each one (engines/base.py); None: local worker processes on this machine.
    ``devices``: the parallel plan's device slots (campaign/devices.py); a local run takes a free slot."""
    plan_file = folder / "plan.json"
    running: Engine = engine if engine is not None else LocalEngine(folder, devices, plan.processes)

    def one(r: dict) -> None:
        with Ledger(ledger_path) as led:
            if running.stopping.is_set():
                led.finish_campaign_run(r["run_id"], NOT_STARTED)
                return
            if deadline is not None and time.time() > deadline:
                led.finish_campaign_run(r["run_id"], RunEnd(RunStatus.NOT_RUN, StopKind.BUDGET, "budget: not started "
                                                            "before the campaign's time budget ran out", 0))
                return
            lock = collect_lock(r["spec"])
            drift = _env_drift(control_lock, lock)
            led.set_lock(r["run_id"], lock)
            if drift and not allow_drift:
                led.finish_campaign_run(r["run_id"], RunEnd(
                    RunStatus.REFUSED, StopKind.LOCK_DRIFT, f"the lock drifted from the campaign's "
                    f"({', '.join(drift[:4])}); rerun with --allow-drift to run it, "
                    "flagged and kept out of comparisons",
                    0))
                return
            if drift:
                led.merge_meta(r["run_id"], {"lock_drift": drift})
            led.set_status(r["run_id"], RunStatus.RUNNING)
        try:
            running.launch(r, ledger_path, plan_file, deadline, plan.threads)
        finally:
            record_lost_end(r, ledger_path, running.stopping.is_set(), r["run_id"] in running.started, running.how)
        if on_event:
            with Ledger(ledger_path) as led:
                on_event(led.run(r["run_id"]))

    try:
        if parallel > 1:
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                futures = [pool.submit(one, r) for r in runs]
                try:
                    for f in futures:
                        f.result()
                except KeyboardInterrupt as exc:
                    # The pool then drains: queued runs see the flag and record not-run.
                    running.stop_all(as_interrupted(exc).how)
                    raise
        else:
            for r in runs:
                one(r)
    except KeyboardInterrupt as exc:
        running.stopping.set()
        running.how = as_interrupted(exc).how
        for r in runs:
            record_lost_end(r, ledger_path, True, r["run_id"] in running.started, running.how)
        raise CampaignInterrupted(finish(campaign_id, ledger_path, interrupted=True),
                                  as_interrupted(exc).signum) from None


def record_lost_end(r: dict, ledger_path: Path, stopping: bool, started: bool, how: str = "Ctrl-C") -> None:
    """A run whose worker died without recording its end, or that never started, still gets a row that says so."""
    with Ledger(ledger_path) as led:
        row = led.run(r["run_id"])
        if row is None or row["status"] not in (RunStatus.RUNNING, RunStatus.PLANNED):
            return
        log = r["out"] / "worker.log"
        if stopping and (row["status"] == RunStatus.PLANNED or not started):
            end = NOT_STARTED
        elif stopping:
            end = RunEnd(RunStatus.STOPPED, StopKind.INTERRUPTED, f"{interrupted(how)}; the run's process ended "
                         f"before recording where (log {log})")
        else:
            end = RunEnd(RunStatus.FAILED, StopKind.PROCESS_LOST, "the run's process ended without a result "
                         f"(log {log})")
        led.finish_campaign_run(r["run_id"], end)


def finish(campaign_id: str, ledger_path: Path, interrupted: bool = False, after: str = "") -> dict:
    with Ledger(ledger_path) as led:
        row = led.run(campaign_id)
        assert row is not None
        meta = json.loads(row["meta_json"])
        runs = led.campaign_runs(campaign_id)
        conclusion = conclude(meta["key"], meta["values"], runs, interrupted,
                              (meta.get("parallel") or {}).get("warnings", []))
        meta["conclusion"] = conclusion
        led.set_meta(campaign_id, meta)
        statuses = {r["status"] for r in current(runs)}
        led.end_run(campaign_id, RunStatus.INTERRUPTED if interrupted else
                    RunStatus.FINISHED if statuses <= {RunStatus.FINISHED} else RunStatus.FINISHED_WITH_STOPS)
        led.add_note(campaign_id, f"conclusion{f' after {after}' if after else ''}: " + "; ".join(conclusion["text"]))
    return {"campaign_id": campaign_id, "runs": runs, "conclusion": conclusion, "parallel": meta.get("parallel")}


def led_runs(ledger_path: Path, campaign_id: str) -> list[dict]:
    with Ledger(ledger_path) as led:
        return led.campaign_runs(campaign_id)
