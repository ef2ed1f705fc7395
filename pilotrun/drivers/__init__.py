"""Drivers: whatever runs the job's updates (see ``base.Driver``). Today: pilotrun's own loop."""
from .base import (
    Capability,
    ContractError,
    Driver,
    JobInputs,
    JobProcess,
    ModelDriver,
    NonFiniteError,
    TrainingCheckError,
    Unsupported,
    UpdateRecord,
    UpdateRejected,
)
from .build import DRIVERS, build_driver, build_job, check_job, join_job, load_inputs
from .loop import LoopDriver

__all__ = ["DRIVERS", "Capability", "ContractError", "Driver", "JobInputs", "JobProcess", "LoopDriver", "ModelDriver",
           "NonFiniteError", "TrainingCheckError", "Unsupported", "UpdateRecord", "UpdateRejected", "build_driver",
           "build_job", "check_job", "join_job", "load_inputs"]
