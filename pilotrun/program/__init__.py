"""Pilot the training program a user already has (docs/guides/program.md): ``pilotrun.program()`` returns its handle.

``handle`` (the program's side, stable API), ``env`` (the one place the parent→program variables and event kinds
are named), the spec section ``program:`` (``config/program.py``), the runner, the run comparison and the resume rows
(the parent's side, used by the program driver, :mod:`pilotrun.drivers.program`).

``pilotrun.program`` is this package and is callable: ``job = pilotrun.program()``.
"""
from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from .env import Role

if TYPE_CHECKING:
    from .handle import ProgramHandle, program

__all__ = ["ProgramHandle", "Role", "program"]


def __getattr__(name: str) -> Any:
    """``handle`` (and with it torch, through ``pilotrun.stage``'s measurement) is imported when the program asks for
    it, not by the parent's modules here (the runner, the comparison) nor by a process that only supervises a run."""
    if name in ("ProgramHandle", "program"):
        from . import handle

        return getattr(handle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """``pilotrun.program()`` calls :func:`handle.program`, while ``pilotrun.program`` stays this package."""

    def __call__(self) -> ProgramHandle:
        from .handle import program

        return program()


sys.modules[__name__].__class__ = _CallableModule
