"""The one process-tree policy: every process pilotrun starts (a gate's worker, a user's program, a campaign run)
runs under a keeper (``keeper.py``) in a session of its own, is killed and waited for when its run ends whatever
the verdict, and dies with pilotrun, even by SIGKILL.

``with Tree(cmd, env=env, label="restore") as tree: tree.wait(timeout)`` — leaving the block (normally, on a
timeout or an exception) kills whatever of the tree is still alive; ``tree.ending`` then says what was killed and
what the command left running by itself (``leftovers``: a daemon, its pid and command). Nothing runs unseen: the
keeper is a child subreaper, so a double-forked or ``setsid`` daemon stays in its tree, and every descendant
carries the keeper's token in ``PILOTRUN_RUN_MARKER``, so one that escaped is still found (``/proc/*/environ``).

A campaign or a worker also records its mark (host, pid and start time: a pid alone may have been reused), so
``--resume`` can ask whether the marked process is still alive before it treats a run as cut short::

    mark = process_mark()          # {"host": "gpu-7", "pid": 4242, "started": 1764450000.12}
    assert is_alive(mark)
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from . import keeper
from .keeper import KILL_WAIT_S, MARKER

KEEPER = str(Path(keeper.__file__).resolve())
# Seconds the keeper gets to kill its tree and report after SIGTERM before pilotrun kills what it can find itself.
KEEPER_GRACE_S = KILL_WAIT_S + 5.0
# torchrun keeps a folder per launch (its ranks' error files; their logs under --redirects), by default a new
# /tmp/torchelastic_* that nothing removes: one for every distributed pilot phase, launch and campaign run. Every
# torchrun pilotrun starts gets one inside its run's folder instead. torchrun reads this variable as the default of
# its --log-dir, so a --log-dir in a program's own command still wins, and a value the user set is kept.
TORCHRUN_FOLDER_VAR = "PET_LOG_DIR"


def with_torchrun_folder(env: dict[str, str], folder: Path) -> dict[str, str]:
    """``env`` for a command that may start torchrun: torchrun's own files go under ``folder``."""
    if env.get(TORCHRUN_FOLDER_VAR):
        return env
    return {**env, TORCHRUN_FOLDER_VAR: str(folder)}


@dataclass
class Ending:
    """How a tree ended: the pids SIGKILLed, those the command left running by itself (each ``{pid, command}``,
    killed too), and those still alive after SIGKILL (stuck in the kernel)."""

    killed: list[int] = field(default_factory=list)
    leftovers: list[dict] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)


def leftover_text(leftovers: list[dict], shown: int = 3) -> str:
    """Processes a command left running (``Ending.leftovers``), for a row's reason: "pid 41 (sleep 300); ..."."""
    text = "; ".join(f"pid {p.get('pid')} ({p.get('command') or 'command unknown'})" for p in leftovers[:shown])
    return text + (f" and {len(leftovers) - shown} more" if len(leftovers) > shown else "")


class Tree:
    """One command under its keeper. ``pid`` is the keeper's (alive exactly as long as the run), ``returncode`` the
    command's (a command killed by signal N reads ``-N``). Signals sent with ``send_signal`` reach the command."""

    def __init__(self, cmd: list[str], *, env: dict[str, str], label: str = "run", **popen) -> None:
        self.token = f"{label}-{os.getpid()}-{secrets.token_hex(6)}"
        env = dict(env)
        env[MARKER] = ",".join(filter(None, [env.get(MARKER), self.token]))  # nested trees keep every token
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", KEEPER, "--marker", self.token, "--parent", str(os.getpid()),
                 "--report", str(write_fd), "--", *cmd],
                env=env, start_new_session=True, pass_fds=(write_fd,), **popen)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._report_fd: int | None = read_fd
        self.ending: Ending | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stdout(self):
        return self.proc.stdout

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout=timeout)

    def send_signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def kill(self) -> Ending:
        """SIGKILL the command and everything it started, wait for them; what was killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the keeper's "kill the tree"
            try:
                self.proc.wait(timeout=KEEPER_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        return self.finish()

    def finish(self) -> Ending:
        """Once the keeper is gone (or after killing it): its report, and a last sweep for marked processes."""
        if self.ending is not None:
            return self.ending
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        ending = self._read_report()
        swept, stuck = sweep(self.token)  # the keeper was SIGKILLed, or a process cleared itself from its tree
        ending.killed += [p for p in swept if p not in ending.killed]
        ending.survivors = sorted(set(ending.survivors) | set(stuck))
        self.ending = ending
        return ending

    def _read_report(self) -> Ending:
        fd, self._report_fd = self._report_fd, None
        if fd is None:
            return Ending()
        try:
            os.set_blocking(fd, False)
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        finally:
            os.close(fd)
        try:
            report = json.loads(data) if data else {}
        except ValueError:
            report = {}
        if not isinstance(report, dict):
            report = {}
        return Ending([int(p) for p in report.get("killed") or []], list(report.get("leftovers") or []),
                      [int(p) for p in report.get("survivors") or []])

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def marked(token: str) -> list[psutil.Process]:
    """The live processes carrying ``token`` in their marker, whatever their parent."""
    out = []
    for p in psutil.process_iter():
        try:
            if token in (p.environ().get(MARKER) or "").split(",") and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def sweep(token: str) -> tuple[list[int], list[int]]:
    """SIGKILL every process carrying ``token``; the pids killed and those alive ``KILL_WAIT_S`` later."""
    found = [p for p in marked(token) if p.pid != os.getpid()]
    for p in found:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(found, timeout=KILL_WAIT_S)
    return [p.pid for p in found], [p.pid for p in alive]


def process_mark(pid: int | None = None) -> dict:
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "started": psutil.Process(pid).create_time()}


def is_alive(mark: dict | None) -> bool | None:
    """True or False on this host; None when it cannot be known (no mark, or another host)."""
    if not mark or mark.get("host") != socket.gethostname():
        return None
    try:
        proc = psutil.Process(int(mark["pid"]))
        return abs(proc.create_time() - float(mark["started"])) < 0.5 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.AccessDenied:  # another user's process with that pid exists: do not call it dead
        return True
    except (psutil.NoSuchProcess, KeyError, ValueError):
        return False
