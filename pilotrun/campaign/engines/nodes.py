"""A campaign whose every run spans several nodes: node 0 runs the campaign, every other node follows it.

Every node runs the same command (a SkyPilot task of ``num_nodes`` above 1 runs its script on each)::

    pilotrun campaign sweep.yaml --task-id "$TASK" --nnodes 2 --node-rank "$NODE" \\
        --rdzv-endpoint "$HEAD:29500" --nproc-per-node 8

Node 0 plans, checks, records and orders the runs exactly as on one machine (the local engine, one run at a time,
the ledger written only there). Before each run it offers the run on a small TCP store at HEAD:PORT+1 (torch's
``TCPStore``, what torchrun's own rendezvous is built on): its id, its variant and seed, its spec's config hash, its
plan and deadline. Each other node builds that run's spec from *its own* copy of the campaign file and takes the run
only when the config hash is the same (nothing node 0 sends is imported or unpickled: a node whose files differ
refuses, and the run is recorded as failed with that reason). Then every node starts its share of the run's ranks
under torchrun's static rendezvous at HEAD:PORT: node R holds ranks R*P .. R*P+P-1, so the run's rank 0, which
writes the validations and the run's end, is always on node 0. Another node's ranks keep their update points in a
spool on its own disk (spool.py) and hand them to node 0 through the store when the run ends; node 0 writes them.

When node 0's command ends, whatever the reason, it says so on the store with its exit code, and every other node
ends with that code. A node 0 that is lost ends the others (exit 1): a task's recovery restarts every node, and
``--task-id`` continues the campaign. Node R's points of a run cut short with node 0 are in its spool, not the ledger.

Example (pure)::

    g = NodeGroup(nnodes=2, node_rank=1, per_node=8, endpoint="10.0.0.5:29500")
    g.world, g.store_port, g.torchrun(["--run-id", "r01"])[3:6]
    # 16, 29501, ['--nnodes=2', '--node-rank=1', '--nproc-per-node=8']
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from ... import strategies
from ...devices import query_host
from ...ledger.records import RunEnd, RunStatus, StopKind
from ...ledger.store import Ledger
from ...procs import Tree, with_torchrun_folder
from ...workers.common import write_spec_file
from .. import kinds
from ..spec import base_spec, load_campaign, run_spec
from ..spool import SpoolReader, write_item
from ..stops import STOP_SIGNAL, tell_ranks
from .base import EngineRefusal
from .local import STOP_GRACE_S, LocalEngine, worker_threads_env

# How long node 0 waits for every other node to take a run (build its spec, check it) before recording it as
# failed, and for their rows once its own ranks ended; how long a follower waits for node 0's store to answer.
TAKE_WAIT_S = 600.0
ROWS_WAIT_S = 120.0
STOP_ROWS_WAIT_S = 20.0
END_WAIT_S = 120.0
# A store value stays under this (the libuv store refuses one over 8 MiB).
CHUNK_BYTES = 4 << 20
# A run id as node 0 writes it (ledger.records.new_run_id, then -rNN): a path part on every node, so checked.
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
CONNECT_WAIT_S = 900.0
POLL_S = 0.2


class NodeError(Exception):
    """The nodes cannot run the campaign together as given: the message names the flag or file and the fix."""


class NodeLost(Exception):
    """Node 0 went away while this node followed it (exit 1: a task's recovery restarts every node)."""


@dataclass(frozen=True)
class NodeGroup:
    """Where this node stands in the cluster every run spans."""

    nnodes: int        # nodes in the cluster, each running the same command
    node_rank: int     # this node: 0 runs the campaign and writes the ledger
    per_node: int      # processes (one per accelerator) on each node
    endpoint: str      # HOST:PORT of node 0: torchrun's rendezvous at PORT, the campaign's store at PORT+1

    def __post_init__(self) -> None:
        if self.nnodes < 2 or not 0 <= self.node_rank < self.nnodes:
            raise NodeError(f"--nnodes {self.nnodes} --node-rank {self.node_rank}: --nnodes is at least 2 for a "
                            "campaign over several nodes and --node-rank is 0 .. nnodes-1")
        if self.per_node < 1:
            raise NodeError(f"--nproc-per-node {self.per_node}: give the processes (accelerators) of each node")
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise NodeError(f"--rdzv-endpoint {self.endpoint!r}: give HOST:PORT of node 0 (its address the other "
                            "nodes reach, and a free port; the next port is used too)")

    @property
    def host(self) -> str:
        return self.endpoint.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])

    @property
    def store_port(self) -> int:
        return self.port + 1

    @property
    def world(self) -> int:
        return self.nnodes * self.per_node

    def torchrun(self, worker_args: list[str]) -> list[str]:
        """This node's share of one run: torchrun's static rendezvous at node 0, so ranks follow the node order."""
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}",
                f"--node-rank={self.node_rank}", f"--nproc-per-node={self.per_node}", f"--master-addr={self.host}",
                f"--master-port={self.port}", "-m", "pilotrun.campaign.worker", *worker_args]

    def to_dict(self) -> dict:
        return {"nnodes": self.nnodes, "per_node": self.per_node, "endpoint": self.endpoint, "world": self.world}


def _store(group: NodeGroup, leader: bool, wait_s: float):
    from torch.distributed import TCPStore  # here: a program's campaign never imports torch

    return TCPStore(group.host, group.store_port, is_master=leader, wait_for_workers=False,
                    timeout=timedelta(seconds=wait_s))


def _wait_for(store, key: str, wait_s: float) -> dict | None:
    """The JSON value at ``key`` once set, or None after ``wait_s`` (a broken connection raises)."""
    end = time.monotonic() + wait_s
    while not store.check([key]):
        if time.monotonic() > end:
            return None
        time.sleep(POLL_S)
    return json.loads(store.get(key))


def send_rows(store, key: str, items: list) -> None:
    """A node's rows of one run under ``key``, in chunks the store takes (its libuv server refuses a value over
    8 MiB); the head, written last, says how many there are."""
    chunks: list[list[str]] = [[]]
    size = 0
    for item in items:
        text = json.dumps(item, default=str)
        if chunks[-1] and size + len(text) > CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(text)
        size += len(text) + 1
    for k, chunk in enumerate(chunks):
        store.set(f"{key}/{k}", "[" + ",".join(chunk) + "]")
    store.set(key, json.dumps({"chunks": len(chunks)}))


def take_rows(store, key: str, wait_s: float) -> list | None:
    """The rows :func:`send_rows` put under ``key`` (deleted from the store once read), or None after ``wait_s``."""
    head = _wait_for(store, key, wait_s)
    if head is None:
        return None
    items: list = []
    for k in range(int(head["chunks"])):
        items += json.loads(store.get(f"{key}/{k}"))
        store.delete_key(f"{key}/{k}")
    store.delete_key(key)
    return items


@dataclass
class Offered:
    """What the other nodes said to one offered run: those that refused it (why) and those that never answered."""

    refused: list[str]
    silent: list[int]

    def problems(self) -> list[str]:
        return self.refused + [f"node {n} did not take the run within {TAKE_WAIT_S:g} s (its `pilotrun campaign` "
                               "ended, or never started with the same --rdzv-endpoint)" for n in self.silent]


class Leader:
    """Node 0's side of the store, open for the whole command: ``end(code)`` tells every other node to end."""

    def __init__(self, group: NodeGroup) -> None:
        assert group.node_rank == 0
        self.group = group
        try:
            self.store = _store(group, leader=True, wait_s=TAKE_WAIT_S)
        except Exception as exc:  # noqa: BLE001 — torch's store errors differ by version; each means "cannot listen"
            first = (str(exc).splitlines() or [""])[0][:120]
            raise NodeError(f"--rdzv-endpoint {group.endpoint}: node 0 cannot open the campaign's store on port "
                            f"{group.store_port} ({type(exc).__name__}: {first}); give a port whose next one is "
                            "free too") from None
        self.offered = 0
        self.lost: list[str] = []  # the nodes that stopped answering: the runs after are not run (resumable)

    def __enter__(self) -> Leader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end(1 if exc[0] is not None else 0)  # once only: a second end() does nothing

    def offer(self, run: dict) -> Offered:
        """Offer one run to every other node; once each took it (or refused, or stayed silent) say whether it goes."""
        index = self.offered
        self.offered += 1  # first: an end() after an interrupt here never overwrites the offer
        self.store.set(f"run/{index}", json.dumps(run))
        said = Offered([], [])
        for node in range(1, self.group.nnodes):
            answer = _wait_for(self.store, f"took/{run['run_id']}/{node}", TAKE_WAIT_S)
            if answer is None:
                said.silent.append(node)
            elif answer.get("refused"):
                said.refused.append(f"node {node} refused it: {answer['refused']}")
        # Every node starts its ranks only on this word: none waits in a rendezvous node 0 will not join.
        self.store.set(f"go/{run['run_id']}", json.dumps({"go": not said.problems()}))
        return said

    def collect(self, run_id: str, ledger: Path, wait_s: float = ROWS_WAIT_S) -> list[str]:
        """Every other node's rows of the run, into the ledger; the nodes whose rows did not come, in words."""
        missing = []
        for node in range(1, self.group.nnodes):
            items = take_rows(self.store, f"rows/{run_id}/{node}", wait_s)
            if items is None:
                missing.append(f"node {node}'s ranks' points did not arrive within {wait_s:g} s (they are in "
                               "its spool, on its own disk)")
                continue
            with Ledger(ledger) as led:
                for item in items:
                    write_item(led, item)
        return missing

    def end(self, code: int) -> None:
        """Tell the other nodes the command ended (its exit code), and give them a while to read it: a node still
        finishing its own earlier step (a restart that finds nothing to run) reads it when it gets here."""
        if self.store is None:
            return
        self.store.set(f"run/{self.offered}", json.dumps({"end": code}))
        waiting = [] if self.lost else list(range(1, self.group.nnodes))
        deadline = time.monotonic() + END_WAIT_S
        for node in waiting:
            _wait_for(self.store, f"ended/{node}", max(0.0, deadline - time.monotonic()))
        self.store = None


def plan_nodes(group: NodeGroup, requested: int | None, spec, processes: int, cpus: int) -> dict:
    """The campaign's plan when every run spans the nodes (the keys of ``resources.plan_parallel``): one run at a time,
    each of the cluster's world size, ``cpus // per_node`` threads per process. EngineRefusal for what cannot run so:
    a program's campaign, a single-process strategy, a ``gpus_per_run`` (``processes``) that is not the world size,
    or ``--parallel`` above 1. Pure."""
    g = group
    if not kinds.of(spec).over_nodes:
        raise EngineRefusal(f"--nnodes {g.nnodes}: a campaign of your program over several nodes is not supported "
                            "(its runs start the program's own launcher on one node); run it on one node, or "
                            "campaign pilotrun's loop")
    if not strategies.get(spec.distributed.strategy).multi_process:
        raise EngineRefusal(f"--nnodes {g.nnodes}: each run is one group of {g.world} processes over the nodes, "
                            f"but the base's distributed.strategy is {spec.distributed.strategy}: set it to "
                            f"{' or '.join(strategies.multi_process_names())}")
    if processes > 1 and processes != g.world:
        raise EngineRefusal(f"gpus_per_run is {processes}, but --nnodes {g.nnodes} x --nproc-per-node {g.per_node} "
                            f"make each run {g.world} ranks: set gpus_per_run to {g.world}, or leave it out")
    if requested not in (None, 1):
        raise EngineRefusal(f"--parallel {requested}: with --nnodes every run spans all the nodes, so runs go one at "
                            "a time: leave out --parallel")
    threads = max(1, cpus // g.per_node)
    return {"requested": 1, "parallel": 1, "threads_per_run": threads, "reasons": [], "engine": "nodes",
            "checked": [], "not_checked": ["memory not checked across the nodes: the pilot of the whole cluster is "
                                           "what proves a run fits"],
            "nodes": g.to_dict(),
            "text": f"one run at a time, each {g.world} ranks over {g.nnodes} nodes x {g.per_node}, {threads} CPU "
                    "thread(s) each; node 0 writes the ledger"}


class NodesEngine(LocalEngine):
    """The local engine on node 0 of a cluster every run spans (module docstring): one run at a time."""

    def __init__(self, leader: Leader) -> None:
        super().__init__(None, None, ranks=leader.group.per_node)
        self.leader, self.group = leader, leader.group

    @property
    def grouped(self) -> bool:
        return True

    def command(self, run_id: str, worker_args: list[str]) -> list[str]:
        return self.group.torchrun(worker_args)

    def plan(self, requested: int | None, runs: int, spec, per_run, processes: int = 1) -> dict:
        return plan_nodes(self.group, requested, spec, processes, query_host().cpus)

    def launch(self, r: dict, ledger: Path, plan_file: Path, deadline: float | None, threads: int | None) -> None:
        if self.stopping.is_set():
            return
        if self.leader.lost:  # a node stopped answering: what is left waits for a restart of the whole cluster
            self._not_run(ledger, r["run_id"], f"{'; '.join(self.leader.lost)}: not started")
            return
        offer = {"run_id": r["run_id"], "config_hash": r["spec"].config_hash(), "out": str(r["out"]),
                 "plan": json.loads(plan_file.read_text()), "deadline": deadline, "threads": threads}
        said = self.leader.offer(offer)
        if said.silent:
            self.leader.lost += [f"node {n} stopped answering" for n in said.silent]
            self._not_run(ledger, r["run_id"], "not started on the cluster: " + "; ".join(said.problems()))
            return
        if said.refused:
            with Ledger(ledger) as led:
                led.finish_campaign_run(r["run_id"], RunEnd(RunStatus.FAILED, StopKind.ERROR,
                                                            "not started on the cluster: " + "; ".join(said.refused),
                                                            0))
            return
        try:
            super().launch(r, ledger, plan_file, deadline, threads)
        except BaseException:
            # Stopping (a preemption's SIGTERM has a short grace), or this node's own error: a short wait.
            self._collect(r["run_id"], ledger, STOP_ROWS_WAIT_S)
            raise
        self._collect(r["run_id"], ledger, STOP_ROWS_WAIT_S if self.stopping.is_set() else ROWS_WAIT_S)

    def _collect(self, run_id: str, ledger: Path, wait_s: float) -> None:
        missing = self.leader.collect(run_id, ledger, wait_s)
        if missing:
            with Ledger(ledger) as led:
                led.merge_meta(run_id, {"nodes_missing": missing})

    @staticmethod
    def _not_run(ledger: Path, run_id: str, why: str) -> None:
        """Recorded as not run for a lost worker: ``--task-id`` (or ``--resume``) runs it when the cluster restarts."""
        with Ledger(ledger) as led:
            led.finish_campaign_run(run_id, RunEnd(RunStatus.NOT_RUN, StopKind.WORKER_LOST, why, 0))


def follow(group: NodeGroup, campaign: Path, out_root: Path) -> int:
    """Node R's side (R above 0): take each run node 0 offers, run this node's ranks of it, hand their rows back;
    node 0's exit code once its command ended. NodeError when node 0 never answers, NodeLost when it goes away."""
    c = load_campaign(campaign)  # the runs node 0 plans, built from this node's own files
    written = base_spec(c).written
    specs = {spec.config_hash(): spec for spec in (run_spec(c, value, seed, base_written=written)
                                                   for value in c.values for seed in c.seeds)}
    try:
        store = _store(group, leader=False, wait_s=CONNECT_WAIT_S)
    except Exception as exc:  # noqa: BLE001 — torch's store errors differ by version; each means "no node 0"
        raise NodeError(f"node 0's campaign did not answer at {group.host}:{group.store_port} within "
                        f"{CONNECT_WAIT_S:g} s ({type(exc).__name__}): start `pilotrun campaign` on node 0 with "
                        "--node-rank 0 and the same --rdzv-endpoint") from None
    try:
        return _follow(store, group, campaign, specs, out_root)
    except RuntimeError as exc:  # torch's DistError (a RuntimeError): the store's server, node 0, went away
        raise NodeLost(f"node 0 went away ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}); its "
                       "runs' rows are in its ledger, this node's in its spools under "
                       f"{out_root.resolve()}") from None


def _follow(store, group: NodeGroup, campaign: Path, specs: dict, out_root: Path) -> int:
    node, offered = group.node_rank, 0
    while True:
        offer = _wait_for(store, f"run/{offered}", math.inf)
        assert offer is not None
        offered += 1
        if "end" in offer:
            store.set(f"ended/{node}", "1")
            return int(offer["end"])
        run_id = offer.get("run_id")
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
            continue  # not a run node 0 writes: nothing to take (node 0 names the node silent)
        spec = specs.get(offer.get("config_hash"))
        if spec is None:
            store.set(f"took/{run_id}/{node}", json.dumps({"refused": (
                f"its spec (config hash {str(offer.get('config_hash'))[:12]}) is not one that {campaign} gives on "
                f"node {node}: the nodes' files differ (sync the same workdir to every node); nothing node 0 sent was "
                "run")}))
            continue
        store.set(f"took/{run_id}/{node}", json.dumps({"took": True}))
        if not (_wait_for(store, f"go/{run_id}", math.inf) or {}).get("go"):
            continue  # another node refused it, or did not answer: node 0 recorded why
        local = out_root / run_id / f"node{node}"  # this node's own: nodes sharing a disk never share a spool
        try:
            _run_share(group, spec, offer, local)
        except KeyboardInterrupt:  # stopped with the others at an update: this node ends with node 0 told so
            store.set(f"ended/{node}", "1")
            raise
        finally:  # its points go to node 0 whether the run ended or was stopped
            send_rows(store, f"rows/{run_id}/{node}", SpoolReader(local / "spool").new_items())


def _run_share(group: NodeGroup, spec, offer: dict, local: Path) -> None:
    """This node's ranks of one run, their files (spool, log, torchrun's) in ``local``, on this node's disk."""
    local.mkdir(parents=True, exist_ok=True)
    spec_file = write_spec_file(spec, local / "spec.json")
    plan_file = local / "plan.json"
    plan_file.write_text(json.dumps(offer["plan"]))
    # --out is the run's folder as node 0 names it (the bucket, mounted at the same path on every node): a sharded
    # checkpoint's files are written by the ranks that hold them, beside rank 0's.
    args = ["--spec", str(spec_file), "--run-id", offer["run_id"], "--out", offer["out"], "--spool",
            str(local / "spool"), "--plan", str(plan_file)]
    if offer.get("deadline") is not None:
        args += ["--deadline", str(offer["deadline"])]
    env = with_torchrun_folder(worker_threads_env(offer.get("threads")), local / "torchrun")
    with open(local / "worker.log", "w") as log:
        proc = Tree(group.torchrun(args), env=env, label=f"campaign-{offer['run_id']}-node{group.node_rank}",
                    stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait()
        except KeyboardInterrupt:  # this node told to stop: its ranks agree the update with the others, then end
            tell_ranks(proc.pid, STOP_SIGNAL)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            raise
        finally:
            proc.kill()
