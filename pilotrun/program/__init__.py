"""Pilot the training program a user already has (SPEC §10): ``pilotrun.program()`` returns its handle.

``handle`` (the program's side, stable API), ``env`` (the one place the parent→program variables and event kinds
are named), the spec section ``program:`` (``config/program.py``), the runner, the run comparison and the resume rows
(the parent's side, used by the program driver, :mod:`pilotrun.drivers.program`).

``pilotrun.program`` is this package and is callable: ``job = pilotrun.program()``.
"""
from __future__ import annotations

import sys
import types

from .env import Role
from .handle import ProgramHandle, program

__all__ = ["ProgramHandle", "Role", "program"]


class _CallableModule(types.ModuleType):
    """``pilotrun.program()`` calls :func:`handle.program`, while ``pilotrun.program`` stays this package."""

    def __call__(self) -> ProgramHandle:
        return program()


sys.modules[__name__].__class__ = _CallableModule
