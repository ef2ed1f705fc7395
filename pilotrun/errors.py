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
