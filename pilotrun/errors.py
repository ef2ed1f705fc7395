"""Errors the command line answers with exit 2, defined where importing them costs nothing.

``pilotrun`` catches these around every subcommand (``cli/__init__.py``); defining them beside the code that
raises them (``distributed.py``, ``lock.py``, both import torch) would make ``pilotrun --help`` or
``pilotrun ledger`` pay for torch (about 1.3 s of CPU) only to name an exception. Those modules re-export them.
"""
from __future__ import annotations


class LaunchError(RuntimeError):
    """The processes and the spec disagree (a strategy without processes, processes without a strategy), or the
    launcher's environment variables are not usable."""


class ContainerDigestError(ValueError):
    """A container digest was given (flag or environment variable) but is not a digest; the message names which."""


# Exception types that say the code itself is wrong (a call with the wrong arguments, a missing key or attribute),
# not its input: raised by pilotrun's own frame, they are pilotrun's bug.
PROGRAMMING_ERRORS = (TypeError, AttributeError, KeyError, IndexError, NameError, AssertionError, UnboundLocalError)


def is_internal(exc: BaseException) -> bool:
    """Whether ``exc`` is pilotrun's own bug: a programming error raised in a frame of pilotrun's package (the
    innermost; transformers or torch raising on a config the user wrote is the user's to fix)."""
    from pathlib import Path

    if not isinstance(exc, PROGRAMMING_ERRORS):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    package = Path(__file__).resolve().parent
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(package)
