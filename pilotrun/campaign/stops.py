"""How a campaign tells a run to stop, and how a stopped run says why: shared by the engines, the worker and the
run. Free of torch, so that the process supervising a campaign run of the user's own program never imports it."""
from __future__ import annotations

import signal

import psutil

STOP_REASON_FILE = "stopped-by"  # beside the campaign's plan.json: what stopped it ("Ctrl-C", "SIGTERM", ...)
# What the campaign sends a worker to stop it at the next update (SIGINT where there is no SIGUSR1).
STOP_SIGNAL = getattr(signal, "SIGUSR1", signal.SIGINT)


def interrupted(how: str) -> str:
    """A stopped run's reason: "interrupted (SIGTERM)" after a preemption, not "(Ctrl-C)"."""
    return f"interrupted ({how})"


# A rank's command line names the worker module; torchrun's (python -m torch.distributed.run ... -m
# pilotrun.campaign.worker) names it too, but torchrun must not get STOP_SIGNAL: it does not handle SIGUSR1, which
# would end it at once and leave the ranks no time to record where they stopped.
RANK_MODULE = "pilotrun.campaign.worker"
LAUNCHER_MODULES = ("torch.distributed.run", "torchrun")


def tell_ranks(root: int, signum: int = STOP_SIGNAL) -> int:
    """Send ``signum`` to every rank of a run's torchrun group under process ``root`` (a keeper); how many got it.

    Every rank is told, so each agrees on the update to stop at (runner._train reduces the flag over the group).
    A rank's own children (DataLoader workers, forked with its command line) are not ranks: they are left alone."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    workers: dict[int, tuple[psutil.Process, int]] = {}
    for child in children:
        try:
            words = child.cmdline()
            if RANK_MODULE in words and not any(w.endswith(LAUNCHER_MODULES) for w in words):
                workers[child.pid] = (child, child.ppid())  # read before any signal: a rank gone reparents its own
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    told = 0
    for child, parent in workers.values():
        if parent in workers:
            continue
        try:
            child.send_signal(signum)
            told += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return told
