"""The local engine: each run in a fresh worker process on this machine (``--engine local``, the default).

A run of pilotrun's loop with ``gpus_per_run`` above 1 is a torchrun group of that many ranks (each writes its own
update points to the ledger, rank 0 the validations and the run's end). With several accelerators each run takes a
free device slot (campaign/devices.py) through the backend's visibility variable. Every worker runs under a keeper
(pilotrun/procs.py): the run and all it starts end with it, and with this process. A campaign whose every run spans
several nodes is this engine on node 0 with another command per run (engines/nodes.py).

Example::

    engine = LocalEngine(folder, devices=None, ranks=2)   # what orchestrate.execute makes when no engine is given
    engine.launch(run, ledger_path, folder / "plan.json", deadline=None, threads=1)
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from ...interrupt import as_interrupted
from ...ledger.store import Ledger
from ...procs import THREAD_VARS, Tree, process_mark, with_torchrun_folder
from ...workers.common import write_spec_file
from ...workers.launch import worker_env
from ..devices import worker_device_env
from ..stops import STOP_REASON_FILE, STOP_SIGNAL, tell_ranks
from ..worker import group_command

# A worker told to stop (STOP_SIGNAL) records where it stopped; it gets this long before SIGKILL.
STOP_GRACE_S = 60


def worker_threads_env(threads: int | None) -> dict[str, str]:
    """A campaign worker's environment: the run's share of the cores as its thread count, unless the user set one
    (procs.thread_env)."""
    return worker_env() | {var: str(threads) for var in THREAD_VARS if threads and not os.environ.get(var)}


class LocalEngine:
    """The worker processes in flight, so an interrupt reaches every one of them, and the flag that stops new ones.

    ``folder``: the campaign's folder, where the stop reason is written for the workers (None: found from the first
    run's plan file); ``devices``: the parallel plan's device slots, as many as runs at once (a worker takes one);
    ``ranks``: this machine's processes per run (above 1: a torchrun group, ``command``)."""

    def __init__(self, folder: Path | None, devices: dict | None = None, ranks: int = 1) -> None:
        self.devices = devices
        self.ranks = ranks
        self.free: queue.Queue[list[str]] = queue.Queue()
        for slot in (devices or {}).get("slots") or []:
            self.free.put(slot)
        self.reason_file: Path | None = None
        if folder is not None:
            self._reason_in(folder)
        self.how = "Ctrl-C"
        self.procs: dict[str, Tree] = {}
        self.started: set[str] = set()  # run ids whose worker was started (a lost end is "stopped", not "not-run")
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def _reason_in(self, folder: Path) -> None:
        self.reason_file = folder / STOP_REASON_FILE
        self.reason_file.unlink(missing_ok=True)  # a resumed campaign's earlier stop is not this one's

    def command(self, run_id: str, worker_args: list[str]) -> list[str]:
        """The run's processes on this machine: one worker, or a torchrun group of ``ranks``."""
        if self.ranks > 1:
            return group_command(self.ranks, worker_args)
        return [sys.executable, "-m", "pilotrun.campaign.worker", *worker_args]

    def launch(self, r: dict, ledger: Path, plan_file: Path, deadline: float | None, threads: int | None) -> None:
        """One run in a fresh local worker process; returns when it ended (see engines/base.py for the interface)."""
        if self.reason_file is None:
            self._reason_in(plan_file.parent)
        spec_file = write_spec_file(r["spec"], r["out"] / "spec.json")
        args = ["--spec", str(spec_file), "--run-id", r["run_id"], "--out", str(r["out"]), "--ledger", str(ledger),
                "--plan", str(plan_file)] + (["--deadline", str(deadline)] if deadline is not None else [])
        if not (self.devices or {}).get("slots"):
            self._start(r["run_id"], r["out"], args, ledger, threads)
            return
        slot = self.free.get()  # as many slots as threads running runs: one is free
        try:
            self._start(r["run_id"], r["out"], args, ledger, threads, slot)
        finally:
            self.free.put(slot)

    def _start(self, run_id: str, out: Path, args: list[str], ledger: Path, threads: int | None,
               slot: list[str] | None = None) -> int | None:
        """Start the worker (with its device slot, when devices are assigned) and wait for it; its exit code, None
        when it was never started because the campaign is stopping."""
        cmd = self.command(run_id, args)
        with open(out / "worker.log", "w") as log:
            with self.lock:
                if self.stopping.is_set():  # the interrupt came while this run was being prepared
                    return None
                env = worker_threads_env(threads)
                if self.devices is not None and slot is not None:
                    env = worker_device_env(self.devices, env, slot)
                if self.grouped:
                    env = with_torchrun_folder(env, out / "torchrun")  # torchrun's files in the run's folder
                proc = Tree(cmd, env=env, label=f"campaign-{run_id}", stdout=log, stderr=subprocess.STDOUT)
                self.procs[run_id] = proc
                self.started.add(run_id)
            # The worker's mark, so a resume after this process was killed can tell a live run from a dead one; and
            # the devices it was given (the visibility variable's value), so the row says where it ran.
            seen = {self.devices["env_var"]: ",".join(slot)} if self.devices is not None and slot else None
            with Ledger(ledger) as led:
                led.merge_meta(run_id, {"worker": process_mark(proc.pid), **({"devices": seen} if seen else {})})
            try:
                return proc.wait()
            except KeyboardInterrupt as exc:  # only when runs go one at a time: the main thread waits here
                self.stop_all(as_interrupted(exc).how)
                raise
            finally:
                proc.kill()
                with self.lock:
                    self.procs.pop(run_id, None)

    def stop_all(self, how: str) -> None:
        self.how = how
        try:  # before the signal, so each worker's stopped row names the real cause
            if self.reason_file is not None:
                self.reason_file.write_text(how)
        except OSError:
            pass  # the rows then say Ctrl-C; the campaign's own message still names the signal
        self.stopping.set()
        with self.lock:
            procs = list(self.procs.values())
        for p in procs:  # each worker is in a session of its own: a terminal's Ctrl-C reached only this process
            if self.grouped:  # every rank, not torchrun (which SIGUSR1 would end before the ranks record a row)
                tell_ranks(p.pid, STOP_SIGNAL)
            else:
                p.send_signal(STOP_SIGNAL)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()

    @property
    def grouped(self) -> bool:
        """Whether each run is a torchrun group (its ranks are told to stop, not torchrun)."""
        return self.ranks > 1
