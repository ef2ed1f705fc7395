"""The keeper: the one process between pilotrun and every process tree it starts (a worker, a user's program, a
campaign run). Run as a script by path (``python -I keeper.py ...``), standard library only, so it costs an
interpreter start and never imports torch or the user's code.

Why a process of its own: whatever kills pilotrun (SIGKILL, the OOM killer) gives pilotrun no chance to clean up,
and ``PR_SET_PDEATHSIG`` on the direct child alone would leave that child's own children (torchrun's ranks, a
program's ``Popen``, a double-forked daemon) running with nothing enforcing their timeout. The keeper

- is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a descendant that double-forks, or calls ``setsid``, is
  re-parented to the keeper, not to init, so the whole tree stays findable under it;
- marks the tree: ``PILOTRUN_RUN_MARKER`` holds its token, inherited by every descendant that does not clear its
  environment; a process found by the token in ``/proc/*/environ`` belongs to the run even if it escaped the tree;
- dies with pilotrun: ``PR_SET_PDEATHSIG`` wakes it with a signal of its own (``PARENT_GONE``) when its parent
  goes, and, because that signal also fires when the *thread* that started it exits while the parent process lives
  on, the keeper acts only once ``getppid()`` has changed; it polls ``getppid()`` too (platforms without prctl);
- on SIGTERM (pilotrun's "kill the run", or the parent gone) SIGKILLs everything it keeps and exits;
- forwards SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to the command (the campaign's stop request, a user's Ctrl-C);
- when the command ends by itself, SIGKILLs whatever it left (a daemon) and names each one in its report.

A keeper killed by the command it runs writes no report; pilotrun, a child subreaper itself, then finds what the
dead keeper kept and kills it (``procs.Tree.finish``).

It reports on the file descriptor ``--report`` (a pipe pilotrun reads), one JSON object, and exits as the command
did (a command killed by signal N makes the keeper end by signal N, so ``returncode`` reads as before).

    python -I keeper.py --marker TOKEN --parent PID --report FD -- COMMAND...
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

MARKER = "PILOTRUN_RUN_MARKER"
POLL_S = 0.05
# Seconds to wait for SIGKILLed processes to disappear (a process in uninterruptible sleep can take a while).
KILL_WAIT_S = 10.0
FORWARDED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, n))
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
# Not SIGTERM: the death of the parent's starting thread must not read as pilotrun's "kill the run".
PARENT_GONE = getattr(signal, "SIGRTMIN", signal.SIGTERM)
MAX_NAMED = 50  # processes named in the report (a pipe holds 64 KiB; a fork bomb is not listed one by one)


def prctl(option: int, value: int) -> bool:
    """Linux's prctl on this process (procs.py makes pilotrun a subreaper with it too); False where it failed or
    there is none."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process /proc shows."""
    out = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        rest = stat.rsplit(")", 1)[-1].split()  # the command name may hold spaces and parentheses
        if len(rest) >= 2:
            out[int(name)] = (int(rest[1]), rest[0])
    return out


def marked(token: str, table: dict[int, tuple[int, str]]) -> set[int]:
    """The processes whose environment carries ``token`` in ``PILOTRUN_RUN_MARKER`` (a comma-separated list)."""
    needle = f"{MARKER}=".encode()
    out = set()
    for pid in table:
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read(1 << 20)
        except OSError:
            continue
        for entry in environ.split(b"\0"):
            if entry.startswith(needle) and token in entry[len(needle):].decode(errors="replace").split(","):
                out.add(pid)
    return out


def kept(root: int, token: str) -> set[int]:
    """Every live process of the run: ``root``'s descendants and every marked process, zombies left out."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    found |= marked(token, table)
    return {p for p in found - {root, os.getpid()} if table.get(p, (0, "Z"))[1] not in ("Z", "X")}


def describe(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            words = [w.decode(errors="replace") for w in fh.read(4096).split(b"\0") if w]
    except OSError:
        words = []
    return {"pid": pid, "command": " ".join(words)[:300]}


STATUSES: dict[int, int] = {}  # pid -> wait status of every child reaped (the command's is the keeper's own)


def reap() -> None:
    """Collect every finished child (orphans re-parented to the keeper included) without blocking."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        STATUSES[pid] = status


def kill_all(token: str, named: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """SIGKILL every kept process until none is left; the pids killed, and those alive KILL_WAIT_S later."""
    killed: list[int] = []
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        alive = kept(os.getpid(), token)
        if not alive or time.monotonic() > deadline:
            return killed, sorted(alive)
        for pid in sorted(alive):
            if pid not in killed:
                killed.append(pid)
                if named is not None and len(named) < MAX_NAMED:
                    named.append(describe(pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(POLL_S)
        reap()


def _args(argv: list[str]) -> tuple[str, int, int, list[str]]:
    split = argv.index("--")
    opts = dict(zip(argv[:split:2], argv[1:split:2]))
    return opts["--marker"], int(opts["--parent"]), int(opts["--report"]), argv[split + 1:]


def _start(command: list[str]) -> int:
    pid = os.fork()
    if pid == 0:
        for sig in {*FORWARDED, signal.SIGTERM, PARENT_GONE}:
            signal.signal(sig, signal.SIG_DFL)
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            os.write(2, f"pilotrun: cannot run {command[0]!r}: {exc.strerror}\n".encode())
        os._exit(127)
    return pid


def main(argv: list[str]) -> None:
    token, parent, report_fd, command = _args(argv)
    os.set_inheritable(report_fd, False)  # the command never sees the report pipe
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    stop = {"asked": False}
    signal.signal(signal.SIGTERM, lambda s, f: stop.update(asked=True))
    if PARENT_GONE != signal.SIGTERM:
        signal.signal(PARENT_GONE, lambda s, f: None)  # only wakes the sleep: _wait compares getppid()
    prctl(PR_SET_PDEATHSIG, PARENT_GONE)
    if os.getppid() != parent:  # the parent died before prctl took effect
        stop["asked"] = True
    child = _start(command)
    for sig in FORWARDED:
        signal.signal(sig, lambda s, f: _forward(child, s))
    report: dict[str, list] = {"leftovers": [], "killed": [], "survivors": []}
    status = _wait(child, parent, stop)
    if status is None:  # asked to stop, or pilotrun is gone: the whole tree, the command included
        report["killed"], report["survivors"] = kill_all(token)
        status = _status_of(child)
    else:  # the command ended by itself: what it left running is killed and named
        report["killed"], report["survivors"] = kill_all(token, report["leftovers"])
    reap()
    try:
        os.write(report_fd, json.dumps(report).encode()[:60000])
    except OSError:
        pass
    _exit_like(status)


def _forward(child: int, signum: int) -> None:
    try:
        os.kill(child, signum)
    except OSError:
        pass


def _status_of(child: int) -> int:
    while child not in STATUSES:
        try:
            STATUSES[child] = os.waitpid(child, 0)[1]
        except ChildProcessError:
            return STATUSES.get(child, signal.SIGKILL)  # reaped elsewhere and lost: it was killed
        except InterruptedError:
            continue
    return STATUSES[child]


def _wait(child: int, parent: int, stop: dict) -> int | None:
    """The command's wait status once it ends; None when the keeper was asked to stop (or lost its parent) first."""
    while True:
        if stop["asked"] or os.getppid() != parent:
            return None
        reap()
        if child in STATUSES:
            return STATUSES[child]
        time.sleep(POLL_S)


def _exit_like(status: int) -> None:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL has no handler to reset
            pass
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
