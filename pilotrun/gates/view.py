"""What a model-level gate needs from whatever owns the training loop: one protocol, one check per gate.

The checks of ``inspect``, ``batch``, ``accum_equivalence``, ``overfit``, ``export`` and ``reload_eval`` are written
once, in their gate modules, against :class:`TrainingView`. pilotrun's loop implements it
(:class:`pilotrun.gates.loop_view.LoopView`, over the loop driver), and each framework integration implements it as
a small adapter over the framework's own objects (``TrainerView`` in :mod:`pilotrun.integrations.transformers`,
``LightningView`` in :mod:`pilotrun.integrations.lightning`): the same check then runs inside the user's program on
the framework's own model, collate and loss (what else a new framework touches: ``pilotrun/integrations/README.md``).

Every view class derives from :class:`ViewBase` and is checked when it is defined: a method it leaves abstract is a
``TypeError`` naming it at class creation (import time), never an ``AttributeError`` at the first check that calls it
inside a user's run. A base that leaves methods to its subclasses says so (``class FrameworkView(ViewBase,
abstract=True)``). :class:`TrainingView` is the protocol the checks take, so a wrapper that delegates with
``__getattr__`` (the observed window's view) still matches it.

A view answers in the job's own terms, and says where it cannot (:class:`NotMeasured`, which makes the check's row
``skip`` with that reason):

- ``data``: the training and validation examples and the collate, as a :class:`~pilotrun.data.bundle.DataBundle`;
  ``update_ids``: what names an update's examples where the items carry no ``id`` (their dataset positions, when an
  integration reads them);
- ``batching()``: micro batch × accumulation × replicas, the examples, how a window's loss is normalised;
- ``accum_windows()``, ``accumulate(model, micro_batches, device)``, ``one_batch(model, batch, device)``: update
  windows to check, one update's backward as the job computes it, and the same examples as one batch through the
  model's own loss (the reference); ``normalisation_cause(...)`` names the framework's own fix;
- ``model_copy(dtype)``: a private copy of the model (a check never touches the job's own);
- ``overfit_plan()``, ``overfit_updater(model)``, ``target_scores(model, items)``: how a copy learns a few examples;
- ``export(folder)``, ``control_items()``, ``outputs(batch)``, ``reload(artifact, batch, work)``: the framework's own
  artifact and its reload in a fresh process through pilotrun's loading policy.

Example (any view; the loop's is built by the gates, an integration's by its callback)::

    from pilotrun.gates.accum import check_accum
    outcome = check_accum(view)          # an Outcome: verdict, reason, details; GateFailure on a fail
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..ledger.records import TextEnum

if TYPE_CHECKING:
    from ..data.bundle import DataBundle


class NotMeasured(Exception):
    """Raised by a view that cannot give what a check asks (a framework's export is collective, a model class a
    fresh process cannot import); the check's row is ``skip`` with this reason, which says what would enable it."""


class WindowKind(TextEnum):
    """Which update window an accumulation check compares."""

    FIRST = "first"            # the job's first update window, in its data order
    LAST_SHORT = "last-short"  # an epoch's last window, shorter than the others
    SAMPLE = "sample"          # micro batches of the first examples (the framework's sampler order is its own)
    OBSERVED = "observed"      # the micro batches a hand-written loop really ran before its first optimizer step


@dataclass
class Window:
    """The items of each micro batch of one update window, and how to name it to a person."""

    kind: WindowKind
    label: str
    micro: list[list[Any]]


@dataclass(frozen=True)
class Batching:
    """How the job batches its examples, as its own loop does it."""

    micro_batch_size: int
    grad_accum_steps: int
    replicas: int
    examples: int
    drop_last: bool = False
    model_parallel: int = 1
    micro_batches_per_epoch: int | None = None   # the loader's own count per process, where the framework has one
    tokens_per_example: float | None = None
    short_window: str = "a mean over its own examples"  # how an epoch's short last window is normalised
    normalisation: str | None = None             # how any window's loss is normalised (the framework's rule)
    planned: tuple[str, int] | None = None       # the long run's length in updates and where it is set
    warmup_updates: int | None = None
    accum_setting: str = "train.grad_accum_steps"  # where the job sets its accumulation (a row names it)


@dataclass(frozen=True)
class UpdateIds:
    """How the job names the examples of an update where its items carry no ``id``: ``positions`` True when it
    reports their positions in the training dataset instead (an integration reads the indices its DataLoader
    fetched), ``how`` what is read — or, when False, why nothing can be."""

    positions: bool
    how: str


@dataclass(frozen=True)
class OverfitPlan:
    """How a copy of the model learns a few examples: the budget, the thresholds and where they come from."""

    examples: int
    micro_batch_size: int
    max_updates: int
    check_every: int
    lr: float
    loss_below: float | None = None          # None: ``loss_fraction`` of the starting loss
    loss_fraction: float = 0.1
    accuracy_at_least: float | None = None   # None: the accuracy is not a condition
    accuracy_means: str = "of its own targets recovered"  # what the accuracy counts, for the reason
    loss_below_from: str = "a tenth of the starting loss"
    seed: int = 0
    budget_hint: str = ""                    # how to tell a too-small budget apart (the reason's last words)


class Updater(Protocol):
    """One optimizer update of an overfit copy on a few items; the update's loss (NonFiniteError on inf/NaN)."""

    def update(self, items: list, step: int) -> float: ...


@dataclass(frozen=True)
class Artifact:
    """An export as the reload reads it: the folder and the manifest sha256 its export row recorded."""

    folder: Path
    manifest_sha256: str | None


@dataclass
class Exported:
    """What a view's ``export`` wrote (atomically, with a manifest)."""

    folder: Path
    files: dict[str, dict]              # name -> {"sha256", "bytes"}
    total_bytes: int
    manifest_sha256: str
    weights: list[str]                  # the files holding the weights, in the format the reload reads
    weights_format: str = "safetensors"
    tensors: int | None = None          # tensors in the weights, where they can be counted without loading
    written_by: str | None = None       # the framework's own save; None: pilotrun's
    note: str = ""                      # what the reason adds (a pickle that is never read back)
    state: str | None = None            # what the weights are ("after 8 update(s)")
    adapter: dict | None = None         # an adapter export: base identity, merged model, sizes
    details: dict = field(default_factory=dict)


@dataclass
class Reloaded:
    """The fresh process's outputs on the control inputs."""

    outputs: torch.Tensor
    model_class: str
    what: str                           # for the reason: what was rebuilt ("LlamaForCausalLM (from_pretrained)")
    merged_outputs: torch.Tensor | None = None
    stored_float_dtypes: tuple[str, ...] = ()  # the export's float parameters as stored, before any cast
    # The dtypes the job keeps its trained weights in, where the reload casts them to compute (None: not compared):
    # an export of the gathered 2-byte copies instead of the masters would otherwise reload as the same outputs.
    master_dtypes: tuple[str, ...] | None = None


class TrainingView(Protocol):
    """See the module docstring. Every method may raise :class:`NotMeasured`. View classes derive from
    :class:`ViewBase`, which checks them when they are defined."""

    framework: str                # "pilotrun's loop", "transformers.Trainer", "Lightning"
    data: DataBundle
    shift_labels: bool            # a causal LM's labels are shifted by the loss (the first position is never one)
    targets_key: str | None       # the batch field the loss reads targets from; None: the loss picks its own
    requires_targets: bool        # a batch without them breaks the job's contract (pilotrun's factory contract)
    scan_limit: int | None        # training examples inspect counts at most (None: all of them)
    scoring: str | None           # how target_scores scored the overfit subset, when not one example at a time
    reference_note: str | None    # how outputs() ran the model, when not as the job holds it (wrappers set aside)
    # The dtype outputs() computed with in place of the stored float parameters (FSDP2 gathering fp32 master
    # weights in bf16); the reload runs the export's parameters in it too. None: as stored.
    reference_dtype: torch.dtype | None
    reference_device: str         # the device type outputs() computed on ("cpu": the reload's own kernels)
    update_ids: UpdateIds         # what names an update's examples where the items have no id (inspect says it)

    @abstractmethod
    def progress(self, done: int, total: int, text: str) -> None: ...
    @abstractmethod
    def batching(self) -> Batching: ...
    @abstractmethod
    def parameter_count(self) -> int: ...
    @abstractmethod
    def inspect_limits(self) -> tuple[int, float]: ...
    @abstractmethod
    def class_outputs(self) -> tuple[int | None, dict | None, str]: ...
    @abstractmethod
    def parameter_split(self) -> dict | None: ...
    @abstractmethod
    def accum_windows(self) -> list[Window]: ...
    @abstractmethod
    def float64_problem(self) -> str | None: ...
    @abstractmethod
    def model_copy(self, dtype: torch.dtype | None) -> tuple[torch.nn.Module, torch.device]: ...
    @abstractmethod
    def accumulate(self, model: torch.nn.Module, micro: list, device: torch.device) -> float: ...
    @abstractmethod
    def one_batch(self, model: torch.nn.Module, batch: Any, device: torch.device) -> float: ...
    @abstractmethod
    def normalisation_cause(self, counts: list[int], sizes: list[int]) -> str | None: ...
    @abstractmethod
    def declared_per_micro_batch(self) -> bool: ...
    @abstractmethod
    def overfit_plan(self) -> OverfitPlan: ...
    @abstractmethod
    def overfit_items(self, n: int) -> list: ...
    @abstractmethod
    def overfit_updater(self, model: torch.nn.Module, plan: OverfitPlan) -> Updater: ...
    @abstractmethod
    def target_scores(self, model: torch.nn.Module, items: list) -> tuple[float, float | None]: ...
    @abstractmethod
    def random_base(self, model: torch.nn.Module) -> bool | None: ...
    @abstractmethod
    def export(self, folder: Path) -> Exported: ...
    @abstractmethod
    def control_items(self) -> list: ...
    @abstractmethod
    def outputs(self, batch: Any) -> torch.Tensor: ...
    @abstractmethod
    def reload_problem(self, artifact: Artifact) -> str | None: ...
    @abstractmethod
    def reload(self, artifact: Artifact, batch: Any, work: Path) -> Reloaded: ...
    @abstractmethod
    def export_state(self) -> dict[str, torch.Tensor] | None: ...


class ViewBase(TrainingView):
    """The base of every view class (:class:`TrainingView` stays the structural type the checks take, so a wrapper
    that delegates with ``__getattr__`` still passes them): a subclass that leaves a method abstract is a
    ``TypeError`` when it is defined, unless it says ``abstract=True``."""

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # ABCMeta alone refuses an incomplete view only when it is instantiated: inside a user's program, mid-run.
        if abstract:
            return
        missing = abstract_members(cls)
        if missing:
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} is a training view that does not implement "
                            f"{', '.join(missing)}: implement them, or declare the class abstract=True if a subclass "
                            "does")


def abstract_members(cls: type) -> list[str]:
    """The methods (and properties) ``cls`` leaves abstract, from every base: what ``ABCMeta`` would compute after the
    class is created, computed while it is (``__init_subclass__`` runs before ``__abstractmethods__`` is set)."""
    declared = {name for base in cls.__mro__ for name, value in vars(base).items()
                if getattr(value, "__isabstractmethod__", False)}
    return sorted(name for name in declared if getattr(getattr(cls, name, None), "__isabstractmethod__", False))


def tensors_of(batch: Any) -> dict[str, torch.Tensor]:
    """A batch's tensors by name (a tuple's by position), contiguous on the CPU: what a fresh process is given."""
    pairs = batch.items() if isinstance(batch, Mapping) else enumerate(batch if isinstance(batch, (list, tuple))
                                                                     else [batch])
    return {str(k): v.contiguous().cpu() for k, v in pairs if isinstance(v, torch.Tensor)}


Check = Callable[[TrainingView], Any]
