"""``pilotrun campaign FILE --engine ray``: each run is a Ray task on a local Ray instance or a cluster.

The ledger stays with the driver (the ``pilotrun campaign`` process) and only the driver writes it:
a run on a Ray worker sends its rows — per-update points, validations, its end — to a small
:class:`Relay` actor pinned to the driver's node, and a driver thread drains the relay into the ledger.
Checkpoints, exports and predictions go to the run's folder under ``--storage`` (a local folder, or a
shared filesystem every node mounts at the same path); the run's row records that folder and the node.

Ray never replaces a run: tasks have ``max_retries=0`` and ``retry_exceptions=False``, the relay
``max_restarts=0``. A run whose worker or node is lost (typed Ray errors, see :func:`classify`) is
ended ``stopped`` (``StopKind.WORKER_LOST``) at the last update it recorded; ``--resume`` runs it again
as a new linked run, like any run a campaign's interrupt cut short.

Example::

    with RayEngine(EngineChoice("ray"), ledger_path) as eng:
        at_once = eng.plan(requested=None, runs=4, spec=spec, per_run=None)
        execute(runs, ..., at_once["parallel"], ..., engine=eng)
"""
from __future__ import annotations

import enum
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import psutil
import ray
import ray.exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ... import backends
from ...config.load import spec_from_mapping
from ...ledger.records import RunEnd, RunStatus, Series, StopKind
from ...ledger.store import Ledger
from ...procs import Tree, with_torchrun_folder
from ...workers.launch import worker_env
from .. import kinds
from ..resources import PerRun
from ..run_plan import CampaignRunPlan
from ..spec import run_device, run_processes
from ..spool import SpoolReader, end_item, write_item
from ..stops import STOP_REASON_FILE, STOP_SIGNAL, tell_ranks
from ..worker import group_command
from .base import EngineChoice, EngineRefusal

# A local instance is a helper for this campaign, not a cluster: a small object store (the runs exchange only
# rows and per-update points) and no dashboard, so it fits beside the runs on a small machine.
LOCAL_OBJECT_STORE_BYTES = 128 * 2**20
DRAIN_EVERY_S = 0.25   # how often the driver moves relayed rows into the ledger
STOP_POLL_S = 0.5      # how often a run asks whether the campaign is stopping (one actor call)
STOP_GRACE_S = 60      # a run told to stop records where it stopped; then it is cancelled by force
LOCAL_EXIT_WAIT_S = 10  # a local instance's processes get this long to exit after ray.shutdown


class Outcome(enum.Enum):
    """How a Ray task ended, from its typed exception: what the run's row then says."""

    RETURNED = "returned"    # the run recorded its own end through the relay
    LOST = "lost"            # its worker process or node went away: stopped at the last recorded update
    CANCELLED = "cancelled"  # the campaign stopped and cancelled it (queued, or past the stop grace)
    RAISED = "raised"        # pilotrun's code raised outside the run's own error handling: failed


# Ray's errors for "the process running the task is gone", whatever took it: the node died, its raylet
# died, Ray's memory monitor killed the worker, the worker crashed, or the objects it owned were lost.
LOST_ERRORS: tuple[type[BaseException], ...] = (
    rex.WorkerCrashedError, rex.NodeDiedError, rex.LocalRayletDiedError, rex.OutOfMemoryError,
    rex.ObjectLostError, rex.OwnerDiedError, rex.ActorDiedError, rex.ActorUnavailableError)


def classify(exc: BaseException | None) -> Outcome:
    if exc is None:
        return Outcome.RETURNED
    if isinstance(exc, rex.TaskCancelledError):
        return Outcome.CANCELLED
    if isinstance(exc, LOST_ERRORS):
        return Outcome.LOST
    if isinstance(exc, rex.RayTaskError):
        # A task error whose cause is one of the above (e.g. a nested lost object) is still a loss.
        cause = exc.as_instanceof_cause() if hasattr(exc, "as_instanceof_cause") else exc
        return Outcome.LOST if isinstance(cause, LOST_ERRORS) else Outcome.RAISED
    return Outcome.RAISED


def lost_end(exc: BaseException, last_step: int, where: str) -> RunEnd:
    """A run whose worker went away: stopped (not failed: nothing in the run was wrong) where it last recorded."""
    return RunEnd(RunStatus.STOPPED, StopKind.WORKER_LOST,
                  f"the Ray worker running it was lost ({type(exc).__name__}{where}); the last update this run "
                  f"recorded is {last_step}", last_step)


def plan_ray(requested: int | None, runs: int, *, cluster: dict[str, float], gpus_per_run: int, cpus_per_run: int,
             per_run: PerRun | None) -> dict:
    """How many runs at once on the cluster and what each asks Ray for; the same keys as ``plan_parallel``.

    ``cluster`` is ``ray.cluster_resources()`` (CPU, GPU, memory totals). Pure: tested without Ray."""
    cpus, gpus = int(cluster.get("CPU", 0)), int(cluster.get("GPU", 0))
    limits: list[tuple[int, str]] = [(cpus // cpus_per_run, f"the Ray cluster has {cpus} CPU(s), "
                                                            f"{cpus_per_run} per run")]
    if gpus_per_run:
        limits.append((gpus // gpus_per_run, f"the Ray cluster has {gpus} GPU(s), {gpus_per_run} per run "
                                             "(the spec's world size)"))
    not_checked = []
    resources: dict[str, Any] = {"num_cpus": cpus_per_run, "num_gpus": gpus_per_run}
    if per_run is None or not per_run.host_bytes:
        not_checked.append("memory not checked: no pilot of the base spec in the ledger (run `pilotrun run BASE` "
                           "with the same ledger, and each run then asks Ray for the memory it measured)")
    else:
        resources["memory"] = per_run.host_bytes  # Ray then places no more runs on a node than its memory holds
        limits.append((int(cluster.get("memory", 0) // per_run.host_bytes),
                       f"the Ray cluster's memory: {cluster.get('memory', 0) / 2**30:.1f} GiB, one run peaked at "
                       f"{per_run.host_bytes / 2**30:.1f} GiB in pilot {per_run.source}"))
    want = runs if requested is None else min(requested, runs)
    allowed = max(1, min([want] + [n for n, _ in limits]))
    reasons = [why for n, why in limits if n < want]
    return {"requested": requested or runs, "parallel": allowed, "threads_per_run": cpus_per_run,
            "reasons": reasons, "checked": [f"{why}: room for {max(n, 0)}" for n, why in limits],
            "not_checked": not_checked, "engine": "ray", "resources": resources,
            "text": f"Ray: {allowed} run(s) at once" + (f" ({'asked' if requested else 'of'} {want})"
                                                        if allowed != want else "")
                    + f", each {cpus_per_run} CPU" + (f" and {gpus_per_run} GPU" if gpus_per_run else "")}


class _RayNoticesToStderr:
    """sys.stdout while Ray runs: Ray's listener threads print cluster notices (a raylet's death, a worker killed
    for memory) to stdout, and ``ray.shutdown`` prints the ones it held back; they are diagnostics, so they go
    to stderr and ``--json`` output stays parseable."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out, self.err = out, err
        self.shutting_down = False

    def write(self, text: str) -> int:
        ray_s = self.shutting_down or threading.current_thread().name.startswith("ray_")
        return (self.err if ray_s else self.out).write(text)

    def flush(self) -> None:
        self.out.flush()
        self.err.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class Relay:
    """On the driver's node: the rows runs send, until the driver takes them; and the campaign's stop flag."""

    def __init__(self) -> None:
        self.items: list[tuple] = []
        self.stop: str | None = None

    def put(self, items: list[tuple]) -> None:
        self.items.extend(items)

    def take(self) -> list[tuple]:
        out, self.items = self.items, []
        return out

    def stop_all(self, how: str) -> None:
        self.stop = how

    def stopping(self) -> str | None:
        return self.stop


class RelaySink:
    """The run's side of the relay: what ``train_run`` writes to instead of the ledger (runner.RunSink).

    Each write waits until the relay has it, so a run that returns has delivered every row."""

    def __init__(self, relay) -> None:
        self.relay = relay

    def __enter__(self) -> RelaySink:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_metrics(self, run_id: str, series: Series, points: list[dict], rank: int = 0) -> None:
        ray.get(self.relay.put.remote([("metrics", run_id, str(series), list(points), rank)]))

    def finish_campaign_run(self, run_id: str, end: RunEnd, **fields: Any) -> None:
        ray.get(self.relay.put.remote([end_item(run_id, end, fields)]))


def _run_task(payload: dict, run_id: str, out_dir: str, plan_json: dict, deadline: float | None, relay) -> str:
    """On a Ray worker: one campaign run, its rows sent to the relay. Returns "not-started" when the campaign was
    already stopping, else the run's status."""
    if ray.get(relay.stopping.remote()):
        return "not-started"
    ctx = ray.get_runtime_context()
    ray.get(relay.put.remote([("start", run_id, {
        "node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
        "pid": os.getpid(), "gpus": [str(g) for g in ray.get_gpu_ids()], "out_dir": out_dir})]))
    seen: dict[str, Any] = {"at": 0.0, "how": None}

    def how() -> str | None:  # asked between updates, at most every STOP_POLL_S
        if seen["how"] is None and time.monotonic() - seen["at"] > STOP_POLL_S:
            seen["at"], seen["how"] = time.monotonic(), ray.get(relay.stopping.remote())
        return seen["how"]

    plan = CampaignRunPlan.from_json(plan_json)  # a dict on the wire
    if plan.processes > 1:
        return _run_group(payload, run_id, Path(out_dir), plan, deadline, relay, how)
    spec = spec_from_mapping(payload["written"], payload["source"])
    run = kinds.of(spec).run()  # pilotrun's loop, or the supervisor of the user's program
    result = run(spec, run_id, Path(out_dir), None, plan, deadline, lambda: how() is not None,
                 lambda: how() or "Ctrl-C", sink=RelaySink(relay))
    return str(result["status"])


def _run_group(payload: dict, run_id: str, out: Path, plan: CampaignRunPlan, deadline: float | None, relay,
               how: Callable[[], str | None]) -> str:
    """On a Ray worker: the run as ``plan.processes`` ranks under torchrun (pilotrun's own launch: a fresh
    ``--standalone`` group on this node, on the GPUs Ray gave the task), each rank's rows forwarded to the relay."""
    out.mkdir(parents=True, exist_ok=True)
    spool = out / "spool"
    spec_file, plan_file = out / "spec.json", out / "plan.json"
    spec_file.write_text(json.dumps(payload))
    plan_file.write_text(json.dumps(plan.with_threads(1).to_json()))
    cmd = group_command(plan.processes, ["--spec", str(spec_file), "--run-id", run_id, "--out", str(out),
                                            "--spool", str(spool), "--plan", str(plan_file)]
                        + (["--deadline", str(deadline)] if deadline else []))
    reader, told = SpoolReader(spool), False
    with open(out / "worker.log", "w") as log:
        # Under a keeper (pilotrun/procs.py): torchrun's ranks (each in a session of its own) end with the run, and
        # with this Ray worker if Ray kills it.
        proc = Tree(cmd, env=with_torchrun_folder({**worker_env(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
                                                  out / "torchrun"),
                    label=f"campaign-{run_id}", stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                time.sleep(DRAIN_EVERY_S)
                items = reader.new_items()
                if items:
                    ray.get(relay.put.remote(items))
                stop = how()
                if stop and not told:  # every rank is told; they agree on the update to stop at (runner._train)
                    (out / STOP_REASON_FILE).write_text(stop)
                    tell_ranks(proc.pid, STOP_SIGNAL)
                    told = True
        finally:
            proc.kill()  # whatever is left: the task is being torn down, or a rank outlived torchrun
    items = reader.new_items()
    if items:
        ray.get(relay.put.remote(items))
    return f"exit {proc.returncode}"


# max_calls=1: each run in a fresh worker process, as the local engine starts one per run. Ray otherwise reuses a
# CPU task's worker, and what one run left in the process (a factory module's globals, torch's thread count and
# flags, anything imported) would reach the next run of the campaign on that worker.
run_task = ray.remote(max_calls=1)(_run_task)


class RayEngine:
    """The Ray engine (engines/base.py: Engine). A context: Ray is started (or joined) on entry, left on exit."""

    def __init__(self, choice: EngineChoice, ledger_path: Path) -> None:
        self.choice, self.ledger_path = choice, ledger_path
        self.started: set[str] = set()
        self.stopping = threading.Event()
        self.how = "Ctrl-C"
        self.refs: dict[str, Any] = {}
        self.lock = threading.Lock()        # refs, started
        self.drain_lock = threading.Lock()  # rows reach the ledger once each, in the order they were sent
        self.resources: dict[str, Any] = {"num_cpus": 1, "num_gpus": 0}
        self.processes = 1  # one run's processes (plan): the task's CPUs are shared by them
        self._closed = threading.Event()
        self._drainer: threading.Thread | None = None
        self.relay: Any = None

    # -- life cycle -------------------------------------------------------------------------------
    def __enter__(self) -> RayEngine:
        self._stdout = sys.stdout
        self._notices = _RayNoticesToStderr(sys.stdout, sys.stderr)
        sys.stdout = self._notices
        try:
            self._start()
        except BaseException:
            sys.stdout = self._stdout
            raise
        return self

    def _start(self) -> None:
        if self.choice.address:
            ray.init(address=self.choice.address, log_to_driver=False)
        else:
            ray.init(num_cpus=os.cpu_count() or 1, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                     include_dashboard=False, log_to_driver=False)
        try:
            here = ray.get_runtime_context().get_node_id()
            # Pinned to the driver's node: a worker node's death must not take the rows it already sent with it.
            self.relay = Relay.options(  # type: ignore[attr-defined]
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
            ray.get(self.relay.stopping.remote())
        except BaseException:
            ray.shutdown()
            raise
        self._drainer = threading.Thread(target=self._drain_loop, name="pilotrun-ray-drain", daemon=True)
        self._drainer.start()

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        if self._drainer is not None:
            self._drainer.join()
        try:
            self.drain()
        finally:
            self._notices.shutting_down = True
            # A local instance is this process's children (gcs_server, raylet) and theirs (workers, a worker still
            # starting): ray.shutdown ends the node, and a worker it had just started can outlive it for seconds.
            # Waited for, then killed, so the campaign leaves no Ray process behind. A cluster's are not ours.
            ours = psutil.Process().children(recursive=True) if not self.choice.address else []
            ray.shutdown()
            _, left = psutil.wait_procs(ours, timeout=LOCAL_EXIT_WAIT_S)
            for proc in left:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(left, timeout=LOCAL_EXIT_WAIT_S)
            sys.stdout = self._stdout

    def cluster(self) -> dict[str, float]:
        return dict(ray.cluster_resources())

    def plan(self, requested: int | None, runs: int, spec, per_run: PerRun | None, processes: int = 1) -> dict:
        """Runs at once on this cluster, and the resources each asks for (kept for ``launch``): a CPU per process,
        and a GPU per process (the run's world size) unless the spec trains on the CPU."""
        device = run_device(spec)
        gpus = processes if backends.numbered(device) else 0
        cluster = self.cluster()
        if gpus and not cluster.get("GPU"):
            if device != "auto":
                raise EngineRefusal(f"train.device is {device} but the Ray cluster has no GPU: set "
                                    "train.device: cpu (or auto), or give --address of a cluster with GPUs")
            gpus = 0  # auto: the runs use the CPU, as `auto` does on a machine without an accelerator
        at_once = plan_ray(requested, runs, cluster=cluster, gpus_per_run=gpus, cpus_per_run=processes,
                           per_run=per_run)
        self.resources, self.processes = at_once["resources"], processes
        return at_once

    # -- the rows runs send -----------------------------------------------------------------------
    def _drain_loop(self) -> None:
        while not self._closed.wait(DRAIN_EVERY_S):
            try:
                self.drain()
            except Exception:  # noqa: BLE001 — the next drain (or the final one) writes them; never lose the thread
                continue

    def drain(self) -> None:
        """Move every row the relay holds into the ledger (only the driver writes it)."""
        with self.drain_lock:
            items = ray.get(self.relay.take.remote())
            if not items:
                return
            with Ledger(self.ledger_path) as led:
                for kind, run_id, *rest in items:
                    if write_item(led, (kind, run_id, *rest)):
                        continue
                    if kind == "start":
                        with self.lock:
                            self.started.add(run_id)
                        led.merge_meta(run_id, {"ray": rest[0]})

    # -- one run ----------------------------------------------------------------------------------
    def launch(self, r: dict, ledger: Path, plan_file: Path, deadline: float | None, threads: int | None) -> None:
        plan = CampaignRunPlan.from_json(json.loads(plan_file.read_text()))
        # The task's CPUs shared by the processes of the run: a group of ranks, or a program's own launcher's (or
        # gpus_per_run's, where its launcher does not say).
        plan = plan.with_threads(1 if plan.processes > 1 else max(1, int(self.resources["num_cpus"])
                                                                  // max(self.processes, run_processes(r["spec"]))))
        payload = {"source": r["spec"].source, "written": r["spec"].written}
        with self.lock:
            if self.stopping.is_set():
                return
            ref = run_task.options(max_retries=0, retry_exceptions=False, name=r["run_id"], **self.resources).remote(
                payload, r["run_id"], str(r["out"]), plan.to_json(), deadline, self.relay)
            self.refs[r["run_id"]] = ref
        with Ledger(ledger) as led:
            led.merge_meta(r["run_id"], {"ray_task": ref.task_id().hex(), "engine": "ray"})
        error: BaseException | None = None
        try:
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001 — classified by type just below
            error = exc
        finally:
            with self.lock:
                self.refs.pop(r["run_id"], None)
            self.drain()  # every row it sent, before its end is judged
        self._record(r["run_id"], error)

    def _record(self, run_id: str, error: BaseException | None) -> None:
        """The end of a run that could not record its own (a lost worker, an error outside the run's handling)."""
        outcome = classify(error)
        with Ledger(self.ledger_path) as led:
            row = led.run(run_id)
            if row is None or row["status"] not in (RunStatus.RUNNING, RunStatus.PLANNED):
                return  # the run recorded its end
            if outcome == Outcome.LOST and run_id not in self.started:
                led.finish_campaign_run(run_id, RunEnd(RunStatus.NOT_RUN, StopKind.WORKER_LOST, "the Ray worker "
                                                       f"given this run was lost ({type(error).__name__}) before "
                                                       "the run started", 0))
            elif outcome == Outcome.LOST:
                node = (json.loads(row["meta_json"] or "{}").get("ray") or {})
                last = max((m["step"] for m in led.metrics(run_id, Series.TRAIN)), default=0)
                where = f" on node {node.get('node_ip')} ({str(node.get('node_id'))[:12]})" if node else ""
                assert error is not None
                led.finish_campaign_run(run_id, lost_end(error, last, where))
            elif outcome == Outcome.RAISED and not self.stopping.is_set():
                assert error is not None
                # The run's own exception (RayTaskError.cause), not the wrapper whose text is Ray's traceback.
                cause = getattr(error, "cause", None) or error
                last = max((m["step"] for m in led.metrics(run_id, Series.TRAIN)), default=0)
                led.finish_campaign_run(run_id, RunEnd(RunStatus.FAILED, StopKind.ERROR,
                                                       f"{type(cause).__name__}: {str(cause)[:300]}", last))
            # Otherwise (cancelled, not started, lost before it started): the orchestrator's record_lost_end
            # says "not run" or "stopped" with the campaign's stop reason.

    def stop_all(self, how: str) -> None:
        self.how = how
        self.stopping.set()
        try:
            ray.get(self.relay.stop_all.remote(how), timeout=30)
        except Exception:  # noqa: BLE001 — the runs are then cancelled below, which still ends each
            pass
        with self.lock:
            queued = [ref for rid, ref in self.refs.items() if rid not in self.started]
            running = [ref for rid, ref in self.refs.items() if rid in self.started]
        for ref in queued:  # never began: cancelled, recorded "not run"
            ray.cancel(ref)
        _, late = ray.wait(running, num_returns=len(running), timeout=STOP_GRACE_S) if running else ([], [])
        for ref in late:  # told to stop and did not within the grace: stopped, with its last recorded update
            ray.cancel(ref, force=True)
