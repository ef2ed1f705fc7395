"""Stop signals (Ctrl-C, SIGTERM, SIGHUP) turned into one exception, so a stopped run is recorded, not lost.

Spot and preemptible rentals end with SIGTERM (then SIGKILL after a grace period), ``timeout`` and
schedulers send SIGTERM, a closed SSH session sends SIGHUP, and a shell script's background job
inherits SIGINT as ignored. Under :func:`interruptible` each of them raises :class:`Interrupted`
(a ``KeyboardInterrupt``, so every ``except KeyboardInterrupt`` that records a stop keeps working)
carrying the signal, its name and the conventional exit status (128 + signal number).

Example::

    with interruptible():
        try:
            work()
        except Interrupted as exc:
            print(f"stopped by {exc.name}; exit {exc.exit_code}")
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

# Handled where the platform has them (Windows has no SIGHUP).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived: ``signum``, ``name`` ("SIGTERM"), ``how`` (words for people) and ``exit_code``."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        self.signum = int(signum)
        super().__init__(self.name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def how(self) -> str:
        """"Ctrl-C" for SIGINT (what a person pressed), else the signal's name."""
        return "Ctrl-C" if self.signum == signal.SIGINT else self.name

    @property
    def exit_code(self) -> int:
        # The shell's convention for a process ended by a signal: 130 after Ctrl-C, 143 after SIGTERM, 129 SIGHUP.
        return 128 + self.signum


def as_interrupted(exc: KeyboardInterrupt) -> Interrupted:
    """A plain ``KeyboardInterrupt`` (raised outside :func:`interruptible`) is Ctrl-C."""
    return exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)


def raised_by_signal(exc: KeyboardInterrupt) -> bool:
    """Whether a stop signal can have raised ``exc``: an :class:`Interrupted` did; a plain ``KeyboardInterrupt`` only
    where Python's own SIGINT handler is installed (Ctrl-C outside :func:`interruptible`). Under
    :func:`interruptible` every signal raises :class:`Interrupted`, so a plain one was raised by code itself (found
    by the fuzzer: a factory raising KeyboardInterrupt was recorded as "interrupted (Ctrl-C)" with no signal)."""
    if isinstance(exc, Interrupted):
        return True
    return signal.getsignal(signal.SIGINT) is signal.default_int_handler


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread.

    Only the first SIGTERM or SIGHUP raises: a repeat while the stop is being recorded is ignored, so
    that a scheduler's second signal does not cut the ledger write short (its SIGKILL still would).
    A second Ctrl-C always raises, so a person can still break out of a hung clean-up. The previous
    handlers are put back on exit. Outside the main thread signals cannot be handled: it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def on_signal(signum, frame):
        if received and signum != signal.SIGINT:
            return
        received.append(signum)
        raise Interrupted(signum)

    old = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
