"""Starting worker processes from a gate: fresh interpreters, logs kept, results read back as JSON."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pilotrun

from ..procs import Tree, with_torchrun_folder

PACKAGE_ROOT = str(Path(pilotrun.__file__).resolve().parents[1])
DEFAULT_TIMEOUT_S = 3600


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its own error line and where its log is."""


# What torchrun sets for its workers: a worker started from inside a torchrun'd process must not inherit
# them, or it would try to join its parent's process group.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def worker_env() -> dict:
    """This environment for a fresh pilotrun process: torchrun's variables removed, pilotrun importable."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def command(module: str, args: list[str], result: Path, nproc: int = 1) -> list[str]:
    """``python -m module`` for one process; ``torchrun --standalone`` for several (a fresh process group)."""
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "-m", module, *args, "--result", str(result)]
    return [sys.executable, "-m", module, *args, "--result", str(result)]


def _env(result: Path) -> dict[str, str]:
    return with_torchrun_folder(worker_env(), result.parent / "torchrun")


def _read_result(result: Path, log: Path, what: str, returncode: int | None) -> dict:
    if not result.exists():
        tail = log.read_text(errors="replace")[-600:] if log.exists() else ""
        raise WorkerError(f"the {what} process exited with code {returncode} and wrote no result (log {log}): "
                          f"{tail.strip()[-300:]}")
    payload = json.loads(result.read_text())
    if payload.get("error"):
        raise WorkerError(f"the {what} process failed: {payload['error']} (log {log})")
    return payload


def run_worker(module: str, args: list[str], result: Path, log: Path, what: str,
               timeout: float = DEFAULT_TIMEOUT_S, nproc: int = 1) -> dict:
    """Run ``python -m module args`` (or ``nproc`` of them under torchrun) to completion; return the JSON result.
    The worker and all it starts run under a keeper (pilotrun/procs.py): killed on a timeout, an exception or when
    it ends, and with pilotrun if pilotrun is killed."""
    result.unlink(missing_ok=True)
    with open(log, "w") as fh, Tree(command(module, args, result, nproc), env=_env(result), label=what,
                                    stdout=fh, stderr=subprocess.STDOUT) as tree:
        try:
            tree.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree.kill()
            raise WorkerError(f"the {what} process took longer than {timeout:.0f} s and was killed "
                              f"(log {log})") from None
    return _read_result(result, log, what, tree.returncode)


def run_and_kill(module: str, args: list[str], result: Path, log: Path, what: str,
                 timeout: float = DEFAULT_TIMEOUT_S, nproc: int = 1) -> dict:
    """Run a worker until it prints SAVED, then SIGKILL it and its ranks (a real kill, not a clean exit)."""
    result.unlink(missing_ok=True)
    with open(log, "w") as fh:
        proc = Tree(command(module, args, result, nproc), env=_env(result), label=what, stdout=subprocess.PIPE,
                    stderr=fh, text=True)
        deadline = time.monotonic() + timeout
        saved = False
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                fh.write(line)
                if line.strip() == "SAVED":
                    saved = True
                    break
                if time.monotonic() > deadline:
                    break
        finally:
            proc.kill()  # every rank too: torch elastic starts each in a session of its own, the keeper keeps them
            if proc.stdout is not None:
                proc.stdout.close()
    payload = _read_result(result, log, what, proc.returncode)
    if not saved:
        raise WorkerError(f"the {what} process ended (code {proc.returncode}) before saving (log {log})")
    payload["killed_with"] = ("SIGKILL" if proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
                              else proc.returncode)
    return payload
