"""How a campaign tells a run to stop, and how a stopped run says why: shared by the engines, the worker and the
run. Free of torch, so that the process supervising a campaign run of the user's own program never imports it."""
from __future__ import annotations

import signal

STOP_REASON_FILE = "stopped-by"  # beside the campaign's plan.json: what stopped it ("Ctrl-C", "SIGTERM", ...)
# What the campaign sends a worker to stop it at the next update (SIGINT where there is no SIGUSR1).
STOP_SIGNAL = getattr(signal, "SIGUSR1", signal.SIGINT)


def interrupted(how: str) -> str:
    """A stopped run's reason: "interrupted (SIGTERM)" after a preemption, not "(Ctrl-C)"."""
    return f"interrupted ({how})"
