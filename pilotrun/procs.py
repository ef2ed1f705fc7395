"""The one process-tree policy: every process pilotrun starts (a gate's worker, a user's program, a campaign run)
runs under a keeper (``keeper.py``) in a session of its own, is killed and waited for when its run ends whatever
the verdict, and dies with pilotrun, even by SIGKILL.

``with Tree(cmd, env=env, label="restore") as tree: tree.wait(timeout)`` — leaving the block (normally, on a
timeout or an exception) kills whatever of the tree is still alive; ``tree.ending`` then says what was killed and
what the command left running by itself (``leftovers``: a daemon, its pid and command). Nothing runs unseen: the
keeper is a child subreaper, so a double-forked or ``setsid`` daemon stays in its tree, and every descendant
carries the keeper's token in ``PILOTRUN_RUN_MARKER``, so one that escaped is still found (``/proc/*/environ``).

A keeper can be killed by the command it runs (the same user may signal it). pilotrun is then the tree's last
guard: the first ``Tree`` makes this process a child subreaper as well, so what the dead keeper kept (the command,
a daemon it had adopted) is re-parented here, not to init; once the keeper is gone without its report, ``finish``
kills the orphans it adopted (children of this process in a session that is not its own, started after the keeper,
no live keeper), every process carrying the token, and every descendant of either, an environment cleared with
``env -i`` included.

Every tree's command gets a CPU thread count that fits its share of the cores (:func:`thread_env`): OpenMP and MKL
threads for each of its processes (torchrun's ranks share them), and OpenMP threads that wait sleep instead of
spinning. Beside one other busy process on 2 cores the demo's update took 0.6-1.4 s with torch's default (spinning
threads fighting over the cores) and 40-80 ms with one thread. A value the environment already holds wins.

A campaign or a worker also records its mark (host, pid and start time: a pid alone may have been reused), so
``--resume`` can ask whether the marked process is still alive before it treats a run as cut short::

    mark = process_mark()          # {"host": "gpu-7", "pid": 4242, "started": 1764450000.12}
    assert is_alive(mark)
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
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
POLL_S = 0.05
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
WAIT_POLICY_VAR = "OMP_WAIT_POLICY"

# Loggers that transformers' import wakes where torchao is installed (pilotrun's fp8 extra): transformers imports
# torchao for its quantizer, and torchao warns for each CUDA-only extension a CPU build cannot load, torch's pytree
# for each enum torchao registers. Neither concerns the job: pilotrun's own processes (the CLI, its workers) log
# errors only from them (quiet_import_noise); models/quiet.py does the same around a pilot's gates.
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def import_noise_quieted() -> Iterator[None]:
    """Errors only from :data:`IMPORT_NOISE`'s loggers inside; their levels put back on exit (inside a process
    that is not pilotrun's own: a pilot's gates, torchao's import for fp8)."""
    logs = [logging.getLogger(name) for name in IMPORT_NOISE]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(max(log.level, logging.ERROR))
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def quiet_import_noise() -> None:
    """Errors only from :data:`IMPORT_NOISE`'s loggers for the rest of this process: called where a process of
    pilotrun's own starts, never in a user's program (whose logging is its own). Imports nothing."""
    for name in IMPORT_NOISE:
        log = logging.getLogger(name)
        log.setLevel(max(log.level, logging.ERROR))


# Held while a keeper starts and while orphans are looked for: a keeper just started (in a session of its own, not
# yet in _KEEPERS) is never taken for an orphan of another tree.
_LOCK = threading.Lock()
_KEEPERS: set[int] = set()  # the pids of this process's keepers not yet waited for
_SUBREAPER: list[bool] = []  # whether this process was made a child subreaper (once, by its first Tree)


def _become_subreaper() -> None:
    """Orphans of a killed keeper come to this process instead of init, where ``finish`` finds them (Linux only;
    elsewhere the token and the descendants of what carries it are all there is)."""
    if not _SUBREAPER:
        _SUBREAPER.append(keeper.prctl(keeper.PR_SET_CHILD_SUBREAPER, 1))


def with_torchrun_folder(env: dict[str, str], folder: Path) -> dict[str, str]:
    """``env`` for a command that may start torchrun: torchrun's own files go under ``folder``."""
    if env.get(TORCHRUN_FOLDER_VAR):
        return env
    return {**env, TORCHRUN_FOLDER_VAR: str(folder)}


@dataclass(frozen=True)
class HostLoad:
    """The cores this process may run on and the machine's 1-minute load average (None where unknown)."""

    cpus: int
    load_1min: float | None
    # False when the load counts cores this process may not use (its CPU set is a part of the machine's): the
    # load then says nothing about the cores it shares.
    load_is_ours: bool = True

    def spare_cpus(self, own: int = 1) -> int:
        """Cores left to this process's ``own`` busy processes once the others' load is taken off (at least 1)."""
        if self.load_1min is None or not self.load_is_ours:
            return self.cpus
        others = max(0, round(self.load_1min) - own)
        return max(1, self.cpus - others)

    def oversubscribed(self) -> bool:
        """More work wanted the cores than there were: a time measured now is partly the other processes'."""
        return self.load_is_ours and self.load_1min is not None and self.load_1min > self.cpus


def host_load() -> HostLoad:
    """The single place that asks how many cores this process may use and how busy the machine is (tests patch it)."""
    try:
        cpus = len(os.sched_getaffinity(0))  # a container's CPU set, not the host's
    except AttributeError:  # macOS
        cpus = os.cpu_count() or 1
    try:
        load: float | None = os.getloadavg()[0]
    except OSError:
        load = None
    return HostLoad(cpus=cpus, load_1min=load, load_is_ours=cpus >= (os.cpu_count() or cpus))


def thread_share(cpus_available: int, concurrent_processes: int = 1, explicit: int | None = None) -> int:
    """CPU threads for each of ``concurrent_processes`` sharing ``cpus_available`` cores; ``explicit`` (a value the
    user set) wins. Never below 1."""
    if explicit is not None and explicit > 0:
        return explicit
    return max(1, max(1, cpus_available) // max(1, concurrent_processes))


def explicit_threads(env: Mapping[str, str]) -> int | None:
    """The thread count ``env`` already sets (``OMP_NUM_THREADS``), or None when it sets none or a malformed one."""
    value = (env.get(THREAD_VARS[0]) or "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def thread_env(env: Mapping[str, str], processes: int | None = 1, host: HostLoad | None = None) -> dict[str, str]:
    """``env`` for a command whose ``processes`` processes share this process's cores: each variable of
    ``THREAD_VARS`` the environment does not set is their share, and waiting OpenMP threads sleep. ``processes``
    None: unknown (a torchrun with ``--nproc-per-node gpu``), the count is left to the command."""
    out = dict(env)
    out.setdefault(WAIT_POLICY_VAR, "PASSIVE")
    if processes is None:
        return out
    host = host or host_load()
    threads = thread_share(host.spare_cpus(), processes, explicit_threads(env))
    for var in THREAD_VARS:
        if not out.get(var):
            out[var] = str(threads)
    return out


_TORCHRUN = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def command_processes(cmd: Sequence[str]) -> int | None:
    """How many processes ``cmd`` runs at once: a torchrun's ``--nproc-per-node`` (None when not a number), else 1
    (a script that starts torchrun itself is not seen: its ranks each get the whole share)."""
    words = [w for word in cmd for w in word.split()]  # a shell's ``-c "torchrun ..."`` too
    if not any(Path(w).name in _TORCHRUN or w in _TORCHRUN for w in words):
        return 1
    for i, word in enumerate(words):
        name, _, value = word.partition("=")
        if name in ("--nproc-per-node", "--nproc_per_node"):
            value = value or (words[i + 1] if i + 1 < len(words) else "")
            return int(value) if value.isdigit() and int(value) > 0 else None
    return 1  # torchrun's default: one process per node


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
        env = thread_env(env, command_processes(cmd))
        env[MARKER] = ",".join(filter(None, [env.get(MARKER), self.token]))  # nested trees keep every token
        _become_subreaper()
        read_fd, write_fd = os.pipe()
        try:
            with _LOCK:
                self.proc = subprocess.Popen(
                    [sys.executable, "-I", KEEPER, "--marker", self.token, "--parent", str(os.getpid()),
                     "--report", str(write_fd), "--", *cmd],
                    env=env, start_new_session=True, pass_fds=(write_fd,), **popen)
                _KEEPERS.add(self.proc.pid)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        # What the tree starts starts after this, on the same clock (psutil's start times count from the boot time,
        # which /proc gives to the second: time.time() is not comparable with them).
        self.started = _started(self.proc.pid) or 0.0
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
        with _LOCK:
            _KEEPERS.discard(self.proc.pid)
        report = self._read_report()
        # Without its report the keeper was killed (by pilotrun past the grace, or by the command it ran): what it
        # kept is this process's now. With it, a process that cleared itself from the tree is still marked.
        swept, stuck = sweep(self.token, orphans_since=self.started if report is None else None)
        ending = report or Ending()
        ending.killed += [p for p in swept if p not in ending.killed]
        ending.survivors = sorted(set(ending.survivors) | set(stuck))
        self.ending = ending
        return ending

    def _read_report(self) -> Ending | None:
        """What the keeper reported; None when it wrote nothing (it did not end as a keeper ends)."""
        fd, self._report_fd = self._report_fd, None
        if fd is None:
            return None
        try:
            os.set_blocking(fd, False)
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        finally:
            os.close(fd)
        if not data:
            return None
        try:
            report = json.loads(data)
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


def _carries(p: psutil.Process, token: str) -> bool:
    return token in (p.environ().get(MARKER) or "").split(",")


def _orphan(p: psutil.Process, info: dict, since: float, me: int, session: int) -> bool:
    """A child of this process that a killed keeper left: not a keeper of ours, in a session that is not this
    process's (a keeper's session, or one of the tree's own), started after that keeper."""
    if info.get("ppid") != me or p.pid in _KEEPERS or (info.get("create_time") or 0.0) < since:
        return False
    try:
        return os.getsid(p.pid) != session
    except OSError:
        return False


def strays(token: str, orphans_since: float | None = None,
           killed: Mapping[int, float | None] | None = None) -> tuple[set[int], set[int]]:
    """(live, dead) processes of a tree whose keeper is gone: those carrying ``token``, with ``orphans_since`` the
    orphans a killed keeper left this process (:func:`_orphan`), those ``killed`` already (pid -> start time: a pid
    reused since is another process), and every descendant of these; ``dead`` are the zombies among them that are
    this process's children, to reap."""
    me, session = os.getpid(), os.getsid(0)
    parent_of: dict[int, int] = {}
    zombies, roots = set(), set()
    with _LOCK:
        for p in psutil.process_iter(["ppid", "status", "create_time"]):
            info = p.info
            if p.pid == me or info.get("ppid") is None:
                continue
            parent_of[p.pid] = info["ppid"]
            if killed and p.pid in killed and killed[p.pid] == info.get("create_time"):
                roots.add(p.pid)
            try:
                if info.get("status") == psutil.STATUS_ZOMBIE:
                    zombies.add(p.pid)
                    if orphans_since is not None and _orphan(p, info, orphans_since, me, session):
                        roots.add(p.pid)
                elif _carries(p, token) or (orphans_since is not None
                                            and _orphan(p, info, orphans_since, me, session)):
                    roots.add(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(roots), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found - zombies, {p for p in found & zombies if parent_of.get(p) == me}


def _reap(pids: set[int]) -> None:
    """Collect the zombies among ``pids`` that are this process's children (an adopted orphan once killed)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except OSError:  # not a child of this process (or gone)
            pass


def sweep(token: str, orphans_since: float | None = None) -> tuple[list[int], list[int]]:
    """SIGKILL every process of a tree whose keeper is gone (:func:`strays`) until none is left; the pids killed and
    those alive ``KILL_WAIT_S`` later."""
    killed: dict[int, float | None] = {}  # pid -> its start time, in the order killed
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        alive, dead = strays(token, orphans_since, killed)
        _reap(dead)
        if not alive or time.monotonic() > deadline:
            return list(killed), sorted(alive)
        for pid in sorted(alive):
            if pid not in killed:
                killed[pid] = _started(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(POLL_S)


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


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
