"""The gates: one module each, declared in ``base.Gate`` terms and listed in ``registry.GATES``."""
from .base import Gate, GateFailure, Outcome, Product
from .context import PilotContext, SavedCheckpoint
from .registry import BY_NAME, GATE_NAMES, GATES, UnknownGate, depends_on, job_memory_gates, select_gates

__all__ = ["BY_NAME", "GATES", "GATE_NAMES", "Gate", "GateFailure", "Outcome", "PilotContext", "Product",
           "SavedCheckpoint", "UnknownGate", "depends_on", "job_memory_gates", "select_gates"]
