"""The gates, one module each, in the order of SPEC §2."""
from .accum import AccumEquivalenceGate
from .base import Gate, GateFailure, Outcome
from .batch import BatchGate
from .eval import EvalGate
from .export import ExportGate
from .inspect import InspectGate
from .load import LoadGate
from .lock import LockGate
from .overfit import OverfitGate
from .reload_eval import ReloadEvalGate
from .restore import RestoreGate
from .resume import ResumeGate
from .save import SaveGate
from .split import SplitGate
from .steps import FirstStepGate, SteadyStepGate

# The order of SPEC §2.
ALL_GATES: list[type[Gate]] = [
    LockGate, InspectGate, SplitGate, BatchGate, LoadGate, FirstStepGate, SteadyStepGate, AccumEquivalenceGate,
    EvalGate, SaveGate, ExportGate, RestoreGate, ResumeGate, OverfitGate, ReloadEvalGate,
]
GATE_NAMES = [g.name for g in ALL_GATES]
BY_NAME = {g.name: g for g in ALL_GATES}


def select_gates(requested: list[str] | None) -> tuple[list[type[Gate]], list[str]]:
    """The gates to run in order, with prerequisites added; and a note per added prerequisite."""
    if not requested:
        return list(ALL_GATES), []
    unknown = [g for g in requested if g not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown gate(s) {unknown}; known: {', '.join(GATE_NAMES)}")
    wanted = set(requested)
    notes = []
    changed = True
    while changed:
        changed = False
        for name in list(wanted):
            for dep in BY_NAME[name].depends_on:
                if dep not in wanted:
                    wanted.add(dep)
                    notes.append(f"{dep} added: {name} needs it")
                    changed = True
    return [g for g in ALL_GATES if g.name in wanted], notes


__all__ = ["ALL_GATES", "BY_NAME", "GATE_NAMES", "Gate", "GateFailure", "Outcome", "select_gates"]
