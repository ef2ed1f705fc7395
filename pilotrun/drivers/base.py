"""What a driver is: whatever runs the job's updates — pilotrun's own loop, or the user's own program.

The gates talk to a driver through this interface and ask it what it can do
(:class:`Capability`); a gate that needs a capability the driver lacks is written as ``skip``
with the reason, never run on a guess. A driver may also prove gates itself
(:meth:`Driver.proven_rows`): the program driver turns what the program reported into rows, as each
gate's ``on_program`` declaration says. A new driver is one module in ``pilotrun/drivers/`` and a line
in the registry (``drivers/build.py``); see docs/architecture.md.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ..checkpoint.saving import PendingSave
from ..ledger.records import TextEnum

if TYPE_CHECKING:
    from ..config.spec import Spec
    from ..data.bundle import DataBundle
    from ..distributed import DistEnv
    from ..ledger.records import GateRow
    from ..models.loading import LoadedModel
    from ..strategies import Strategy
    from ..train.loss import LossPolicy
    from ..train.sampler import DataPlan


class Capability(str, Enum):
    """What a driver can do; gates declare the ones they require (``Gate.requires``)."""

    UPDATES = "updates"        # runs optimizer updates and reports each one (ids, lr, loss, grad norm)
    MODEL = "model"            # the model, its loss normalisation and the data order are in this process
    FULL_STATE = "full-state"  # saves and restores the full training state (model, optimizer, RNG, data position)
    EXPORT = "export"          # writes an inference artifact that reloads in a fresh process
    RESTART = "restart"        # can be rebuilt in fresh processes from the spec (the restore and resume proofs)

    @property
    def missing(self) -> str:
        """What a gate cannot do without it, in words."""
        return {
            Capability.UPDATES: "run and report updates one at a time",
            Capability.MODEL: "give the model, its batches and its loss normalisation to this process",
            Capability.FULL_STATE: "save and restore the full training state in pilotrun's checkpoint format",
            Capability.EXPORT: "write an inference artifact",
            Capability.RESTART: "be rebuilt in fresh processes from the spec",
        }[self]


class OnProgram(TextEnum):
    """How a gate is proven when the job is the user's own program (``program:`` in the spec): each gate declares
    it (``Gate.on_program``), the program driver acts on it."""

    PILOT = "pilot"              # runs in the pilot's own process, as for any job (lock)
    RUNS = "runs"                # pilotrun runs the program again and compares (resume: control/interrupted/resumed)
    STAGE = "stage"              # from the stage the program reports with job.stage(name), each rank's
    INTEGRATION = "integration"  # recorded from inside the program (job.record_gate) by an integration
    NEVER = "never"              # cannot run on a program: a skip row says why and what would enable it


class GateDeclaration(Protocol):
    """What a driver may read of a gate (a ``pilotrun.gates.base.Gate`` class): its name and how it is proven on a
    program. Drivers sit below the gates, so they see them through this."""

    name: str
    on_program: OnProgram
    program_note: str      # on a program: what it proves there, or why it cannot run and what would enable it
    program_problems: bool  # on a program: its rows carry the invalid values the program reported
    program_combines: bool  # on a program: several stages of its name on one rank are combined (else the first kept)


@dataclass(frozen=True)
class RunSite:
    """Where the pilot's run lives: what a driver that starts processes of its own (the program) writes to."""

    run_id: str
    out_dir: Path
    ledger_path: Path
    progress: Callable[[str], None] = lambda text: None
    # Runs of the program an interrupted pilot finished (pilot/resume.plan_program_resume), by role: kept as they
    # ended instead of run again.
    finished: dict = field(default_factory=dict)


class TrainingCheckError(RuntimeError):
    """A check inside an update refused it before it was applied; the message is the reason."""


class UpdateRejected(TrainingCheckError):
    """The window teaches nothing (no supervised label, no gradient); the optimizer did not step."""


class NonFiniteError(TrainingCheckError):
    """A loss, gradient norm or parameter is inf/NaN; the message names the update and the example ids."""

    def __init__(self, what: str, step: int, value: float, ids: list[str], hint: str = "") -> None:
        self.what, self.step, self.value, self.ids = what, step, value, ids
        shown = ", ".join(ids[:8]) + (f" (+{len(ids) - 8} more)" if len(ids) > 8 else "")
        super().__init__(f"{what} is {value} at update {step}{hint}; examples in that update: {shown}")


class ContractError(TypeError):
    """User code does not follow the factory contract (README, "Your own model and data"); the message says
    which part."""


@dataclass
class UpdateRecord:
    """One optimizer update as a driver reports it."""

    step: int  # 1-based index of this update
    loss: float
    lr: float
    grad_norm: float | None
    sample_ids: list[str]
    examples: int
    tokens: int
    supervised: int
    micro_batches: int
    seconds: float
    data_wait_s: float
    epoch: int
    seq_len: int = 0
    scaler_skipped: bool = False
    extra: dict = field(default_factory=dict)

    def metric(self) -> dict:
        """The ledger's per-update metric row."""
        return {"step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
                "examples": self.examples, "tokens": self.tokens, "seconds": self.seconds,
                "data_wait_s": self.data_wait_s, "sample_ids": self.sample_ids,
                "extra": {"supervised": self.supervised, "micro_batches": self.micro_batches, "epoch": self.epoch,
                          "seq_len": self.seq_len, "scaler_skipped": self.scaler_skipped, **self.extra}}


@dataclass(frozen=True)
class JobProcess:
    """This process's place in the job: its device, its rank in the process group, the strategy running it."""

    device: torch.device
    device_reason: str       # why this device ("auto: no accelerator visible, running on CPU")
    device_name: str         # the accelerator's marketing name (estimates calibrate by it), or the device type
    env: DistEnv
    strategy: Strategy


@dataclass
class JobInputs:
    tokenizer: Any           # the built-in tasks' tokenizer; None for a data factory
    data: DataBundle


class Unsupported(NotImplementedError):
    """A driver was asked for something its capabilities do not include."""


class Driver(ABC):
    """Runs the updates of one job on one device (one rank of several under a multi-process strategy)."""

    name: ClassVar[str]
    capabilities: ClassVar[frozenset[Capability]]
    # True: the load gate builds it in this process (its model lives here). False: the pilot builds it before the
    # gates, from the spec alone (the user's program, run in child processes).
    in_process: ClassVar[bool] = True

    spec: Spec
    device: torch.device
    env: DistEnv
    strategy: Strategy
    step: int               # updates applied so far
    how_wrapped: str        # the strategy's sentence about how the model runs

    @classmethod
    def job_meta(cls, spec: Spec, process: JobProcess) -> dict:
        """What the pilot's run row records of how the job runs (pilotrun's processes here)."""
        return {"world_size": process.env.world_size, "strategy": process.strategy.name}

    @classmethod
    def where(cls, spec: Spec, process: JobProcess) -> str:
        """Where the job runs, for the pilot's first lines (the device chosen and why)."""
        return f"device: {process.device_reason}"

    @classmethod
    @abstractmethod
    def build(cls, spec: Spec, inputs: JobInputs | None, process: JobProcess, on_model=None,
              site: RunSite | None = None) -> Driver:
        """The driver for ``spec`` in this process, ready to update (``on_model`` sees the plain model first;
        ``site`` is the pilot's run, for a driver that starts processes of its own)."""

    def can(self, capability: Capability) -> bool:
        return capability in self.capabilities

    def prepare(self, gates: Sequence[GateDeclaration], known: Sequence[str] = ()) -> None:  # noqa: B027
        """The gates this pilot will run, in order, before the first (a program driver plans its runs from them);
        ``known`` names every gate there is. Most drivers plan nothing."""

    def proven_rows(self, gate: GateDeclaration) -> list[GateRow] | None:
        """The rows of ``gate`` when this driver proves it itself (a program's reported stages, an integration's
        recorded rows, its resume runs, a skip naming what would enable it); None: the gate runs in this process."""
        return None

    def notes(self) -> list[str]:
        """Observations for the run's ledger notes once every gate ran (values that went on no row)."""
        return []

    def update(self, pad_to: int | None = None, strict: bool = False) -> UpdateRecord:
        """One optimizer update in this process. ``pad_to`` pads every micro batch to the long run's worst length
        (when the driver can); ``strict`` refuses, before the optimizer steps, a window that teaches nothing."""
        raise Unsupported(f"the {self.name} driver runs no update in this process")

    def evaluate(self, on_batch=None) -> dict:
        """Validation loss and accuracy (``val_loss``, ``accuracy``, ``examples``, ``batches``)."""
        raise Unsupported(f"the {self.name} driver cannot evaluate in this process")

    def save(self, folder: Path) -> dict:
        """The full training state to ``folder`` (atomically, with a manifest): ``{"files", "bytes",
        "manifest_sha256"}`` (the last: the digest of the manifest bytes written)."""
        raise Unsupported(f"the {self.name} driver cannot {Capability.FULL_STATE.missing}")

    def start_save(self, folder: Path) -> PendingSave:
        """:meth:`save`, returning once the job may go on (a strategy may write behind it): ``wait()`` gives the
        record once the checkpoint is complete."""
        started = time.perf_counter()
        return PendingSave.finished(folder, self.save(folder), started)

    def restore(self, folder: Path) -> dict:
        """Load a checkpoint this driver's strategy wrote; returns the saved trainer state (step, position)."""
        raise Unsupported(f"the {self.name} driver cannot {Capability.FULL_STATE.missing}")

    def fingerprint(self) -> dict:
        """Digests of everything a resumed run depends on, from the live objects."""
        raise Unsupported(f"the {self.name} driver cannot {Capability.FULL_STATE.missing}")

    def export_weights(self) -> Any:
        """What the export needs from every rank (the full weights gathered from shards); every rank calls it."""
        raise Unsupported(f"the {self.name} driver cannot {Capability.EXPORT.missing}")

    def write_export(self, folder: Path, weights: Any = None) -> Any:
        """The inference artifact, written by rank 0 from :meth:`export_weights`; returns the written folder."""
        raise Unsupported(f"the {self.name} driver cannot {Capability.EXPORT.missing}")

    def close(self) -> None:  # noqa: B027 - a driver with nothing to release need not override it
        """Release processes and handles (DataLoader workers)."""


class ModelDriver(Driver):
    """A driver whose model, batches and loss normalisation live in this process (``Capability.MODEL``).

    The gates that check the model itself (accumulation equivalence, overfit, evaluation at the
    longest length, reload) read these; a driver without them gets those gates skipped with the reason.
    """

    model: torch.nn.Module        # as the strategy runs it
    loaded: LoadedModel           # the plain model, where it came from and its head
    data: DataBundle
    tokenizer: Any
    policy: LossPolicy            # how the loss is normalised over an update window, and why
    plan: DataPlan                # the data order
    precision: str
    optimizer: torch.optim.Optimizer
    last_window: dict             # the window of the update in flight (ids, length): what a failure names
    reduction_ratio: float        # measured: 1.0 when the strategy averages gradients over ranks, world size if it sums
    grad_scale: float             # what the loss is scaled by so one update equals one process's

    @property
    @abstractmethod
    def plain_model(self) -> torch.nn.Module:
        """The model outside any wrapper (the parameters the strategy runs)."""

    @abstractmethod
    def plain_model_copy(self) -> torch.nn.Module:
        """A private copy for checks that must not disturb the job (one rank's full model)."""

    @abstractmethod
    def check_parameters_finite(self) -> str | None:
        """The name of the first parameter holding inf/NaN, or None."""

    @abstractmethod
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
