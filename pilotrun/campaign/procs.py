"""Which process runs a campaign or one of its runs, and whether it still does.

A campaign whose own process was killed (SIGKILL, the OOM killer, a reboot) cannot record its
end, so its row says "running" for ever. Each campaign and each worker records a mark — host,
pid and the process's start time (a pid alone may have been reused) — and ``--resume`` asks
whether the marked process is still alive before it treats the campaign as cut short.

Example::

    mark = process_mark()          # {"host": "gpu-7", "pid": 4242, "started": 1764450000.12}
    assert is_alive(mark)
"""
from __future__ import annotations

import os
import socket

import psutil


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
