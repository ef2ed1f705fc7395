"""``os._exit`` called by user code inside pilotrun's own process becomes an exception, not a silent exit 0.

Factories (model, data) run in the pilot's process: a ``load`` gate calls them. ``sys.exit`` raises
``SystemExit`` and becomes a failed row, but ``os._exit(0)`` ends the process at once: no row,
no report, the ledger's run left ``running``, and the shell sees exit 0 — a false pass. While
the guard is installed, ``os._exit`` in this process raises :class:`ExitCalled` (a ``SystemExit``,
so every place that records a user's ``sys.exit`` as a failed row records it too). A forked
child (a DataLoader worker, multiprocessing) still exits at once, as it must.

Not covered, and said so where it matters: a C extension calling ``_exit(2)`` directly, or a
process killing itself; the run's ledger row then stays ``running`` (``pilotrun ledger`` shows it).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


class ExitCalled(SystemExit):
    """User code called ``os._exit(code)`` in pilotrun's process."""


@contextlib.contextmanager
def guard_os_exit() -> Iterator[None]:
    owner = os.getpid()
    real = os._exit

    def guarded(code: int) -> None:
        if os.getpid() != owner:  # a forked child ends as it always did
            real(code)
        raise ExitCalled(code)

    os._exit = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = real
