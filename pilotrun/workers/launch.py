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

PACKAGE_ROOT = str(Path(pilotrun.__file__).resolve().parents[1])
DEFAULT_TIMEOUT_S = 3600


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its own error line and where its log is."""


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _read_result(result: Path, log: Path, what: str, returncode: int | None) -> dict:
    if not result.exists():
        tail = log.read_text(errors="replace")[-600:] if log.exists() else ""
        raise WorkerError(f"the {what} process exited with code {returncode} and wrote no result (log {log}): {tail.strip()[-300:]}")
    payload = json.loads(result.read_text())
    if payload.get("error"):
        raise WorkerError(f"the {what} process failed: {payload['error']} (log {log})")
    return payload


def run_worker(module: str, args: list[str], result: Path, log: Path, what: str,
               timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Run ``python -m module args`` to completion and return its JSON result."""
    result.unlink(missing_ok=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", module, *args, "--result", str(result)],
                                stdout=fh, stderr=subprocess.STDOUT, env=_env())
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise WorkerError(f"the {what} process took longer than {timeout:.0f} s and was killed (log {log})") from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return _read_result(result, log, what, proc.returncode)


def run_and_kill(module: str, args: list[str], result: Path, log: Path, what: str,
                 timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Run a worker until it prints SAVED, then SIGKILL it (a real kill, not a clean exit)."""
    result.unlink(missing_ok=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", module, *args, "--result", str(result)],
                                stdout=subprocess.PIPE, stderr=fh, env=_env(), text=True)
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
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    payload = _read_result(result, log, what, proc.returncode)
    if not saved:
        raise WorkerError(f"the {what} process ended (code {proc.returncode}) before saving (log {log})")
    payload["killed_with"] = "SIGKILL" if proc.returncode == -signal.SIGKILL else proc.returncode
    return payload
