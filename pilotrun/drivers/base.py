"""What a driver is: whatever runs the job's updates — pilotrun's own loop today, a user's program tomorrow.

The gates talk to a driver through this interface and ask it what it can do
(:class:`Capability`); a gate that needs a capability the driver lacks is written as ``skip``
with the reason, never run on a guess. A new driver (a PEFT-wrapped model, a user's ``train.py``,
a Trainer) is one module in ``pilotrun/drivers/`` and a line in the registry; see
docs/architecture.md.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from ..config.spec import Spec
    from ..data.bundle import DataBundle
    from ..distributed import DistEnv
    from ..models.loading import LoadedModel
    from ..strategies import Strategy
    from ..train.loss import LossPolicy
    from ..train.sampler import DataPlan


class Capability(str, Enum):
    """What a driver can do; gates declare the ones they require (``Gate.requires``)."""

    UPDATES = "updates"        # runs one optimizer update at a time and reports it (ids, lr, loss, grad norm)
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

    spec: Spec
    device: torch.device
    env: DistEnv
    strategy: Strategy
    step: int               # updates applied so far
    how_wrapped: str        # the strategy's sentence about how the model runs

    @classmethod
    @abstractmethod
    def build(cls, spec: Spec, inputs: JobInputs, process: JobProcess, on_model=None) -> Driver:
        """The driver for ``spec`` in this process, ready to update (``on_model`` sees the plain model first)."""

    def can(self, capability: Capability) -> bool:
        return capability in self.capabilities

    @abstractmethod
    def update(self, pad_to: int | None = None, strict: bool = False) -> UpdateRecord:
        """One optimizer update. ``pad_to`` pads every micro batch to the long run's worst length (when the
        driver can); ``strict`` refuses, before the optimizer steps, a window that teaches nothing."""

    def evaluate(self, on_batch=None) -> dict:
        """Validation loss and accuracy (``val_loss``, ``accuracy``, ``examples``, ``batches``)."""
        raise Unsupported(f"the {self.name} driver cannot evaluate in this process")

    def save(self, folder: Path) -> dict:
        """The full training state to ``folder`` (atomically, with a manifest): ``{"files", "bytes"}``."""
        raise Unsupported(f"the {self.name} driver cannot {Capability.FULL_STATE.missing}")

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
