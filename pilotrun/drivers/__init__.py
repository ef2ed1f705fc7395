"""Drivers: whatever runs the job's updates (see ``base.Driver``): pilotrun's own loop, the user's own program."""
from .base import (
    Capability,
    ContractError,
    Driver,
    GateDeclaration,
    JobInputs,
    JobProcess,
    ModelDriver,
    NonFiniteError,
    OnProgram,
    RunSite,
    TrainingCheckError,
    Unsupported,
    UpdateRecord,
    UpdateRejected,
)
from .build import DRIVERS, build_driver, build_job, check_job, driver_class, join_job, load_inputs
from .loop import LoopDriver
from .program import ProgramDriver

__all__ = ["DRIVERS", "Capability", "ContractError", "Driver", "GateDeclaration", "JobInputs", "JobProcess",
           "LoopDriver", "ModelDriver", "NonFiniteError", "OnProgram", "ProgramDriver", "RunSite", "TrainingCheckError",
           "Unsupported", "UpdateRecord", "UpdateRejected", "build_driver", "build_job", "check_job", "driver_class",
           "join_job", "load_inputs"]
