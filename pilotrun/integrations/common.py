"""What the integrations share (the callbacks, accelerate's and Fabric's ``begin``): the update window, the stage
spans, and the probe gates' runner.

The probe gates run in the program's own process (the run whose rows the pilot records), on copies of the
framework's model and on batches from its own dataset and collate, so what they prove is the user's actual setup.
Their checks are the gates' own, written once in :mod:`pilotrun.gates` against a
:class:`~pilotrun.gates.view.TrainingView`; each framework module gives its objects to them through a small view
(:class:`FrameworkView` holds what the two views share: the overfit copy's budget and optimizer, its per-example
scores, the model copies). :func:`run_probes` runs every check and records its row (``job.record_gate``): one broken
check never hides the others.
"""
from __future__ import annotations

import contextlib
import copy
import math
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..config.sections import InspectSpec
from ..data.bundle import DataBundle
from ..drivers import NonFiniteError
from ..gates.base import OnProgram, Outcome, ProbeSite, run_check
from ..gates.registry import GATES
from ..gates.view import Artifact, Batching, OverfitPlan, Reloaded, TrainingView, UpdateIds, ViewBase, tensors_of
from ..models.adapters import parameter_split
from ..program.env import IDS_ARE, IdKind

STEADY_UPDATES = 3        # the steady_step stage spans this many updates after the first
# The overfit copy's budget. Its lr: the question is whether the model can learn its own targets at all, not whether
# the run's lr is good (a tiny GPT-2 learns 4 chats in 50 updates at 3e-3 and does not in 100 at 1e-3, measured on
# CPU); one batch of all its examples per update.
OVERFIT = OverfitPlan(examples=4, micro_batch_size=4, max_updates=100, check_every=10, lr=3e-3)
SCAN_LIMIT = 2048  # training examples inspect counts inside a program (it runs before the program's first update)


def role_name(job) -> str:
    """The handle's role as text (the handle may give an enum or a string)."""
    role = getattr(job, "role", None)
    return str(getattr(role, "value", role) or "")


def runs_probes(job) -> bool:
    """The probes run on rank 0 of the run whose rows the pilot records (control, stages, probe), never in the
    interrupted or resumed runs, whose updates are only compared."""
    from ..program.env import Role

    if getattr(job, "rank", 0) != 0:
        # One process probes: the probes work on copies and need no collective, and one export folder has one
        # writer. The pilot's rows for these gates are rank 0's.
        return False
    try:
        return Role(role_name(job)).records
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------- updates and stages


class UpdateWindow:
    """What one optimizer update saw: the micro batches' losses and sample ids (and what kind of ids), the lr and grad
    norm."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.ids: list[Any] = []
        self.kinds: set[IdKind] = set()
        self.ids_missing = False
        self.lr: float | None = None
        self.grad_norm: float | None = None

    def add(self, loss: float | None, ids: Iterable | None, kind: IdKind = IdKind.ITEM) -> None:
        if loss is not None:
            self.losses.append(float(loss))
        self.add_ids(ids, kind)

    def add_ids(self, ids: Iterable | None, kind: IdKind = IdKind.ITEM) -> None:
        """One micro batch's ids (None: it had none, and the update then reports none)."""
        if ids is None:
            self.ids_missing = True
        else:
            self.ids.extend(plain(i) for i in ids)
            self.kinds.add(kind)

    def report(self, job, update: int, loss: float | None, **extra) -> None:
        ids = None if self.ids_missing or not self.ids else self.ids
        if ids is not None and self.kinds != {IdKind.ITEM}:
            # The resume row names what it compared: positions in the dataset, not the items' own ids.
            extra[IDS_ARE] = str(next(iter(self.kinds)) if len(self.kinds) == 1 else IdKind.MIXED)
        job.update(update, loss=loss, lr=self.lr, grad_norm=self.grad_norm, ids=ids, **extra)


def plain(value: Any) -> Any:
    """A sample id as JSON can hold it (a 0-d tensor or numpy scalar becomes its Python value)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value.item() if hasattr(value, "item") and not isinstance(value, (str, bytes)) else value


def ids_of(batch_or_items: Any) -> list | None:
    """Sample ids of a collated batch (its ``id`` field) or of a list of items (each item's ``id``); None if absent."""
    if isinstance(batch_or_items, (list, tuple)):
        if batch_or_items and all(isinstance(it, dict) and "id" in it for it in batch_or_items):
            return [plain(it["id"]) for it in batch_or_items]
        return None
    if hasattr(batch_or_items, "keys") and "id" in batch_or_items.keys():
        ids = batch_or_items["id"]
        return [plain(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
    return None


# ------------------------------------------------------------------------------------------ dataset positions


POSITIONS_READ = ("the positions in the training dataset its DataLoader's sampler yielded for each micro batch "
                  "(the indices the loader fetched)")


class Positioned(list):
    """The items one fetch of the training DataLoader returned, with ``positions``: their indices in its dataset."""

    positions: list


class PositionTap:
    """Set as the training dataset's own ``__getitems__``: torch's DataLoader calls it with the indices its sampler
    yielded for one batch — after every batch sampler, shard (``BatchSamplerShard``) or skip (``skip_first_batches``)
    layer accelerate or Lightning put around it, and in the worker process that fetches — so the positions are those
    of the very examples the collate receives. It returns them as a :class:`Positioned` list, or hands them to
    ``on_fetch`` (in the main process) and returns a plain list."""

    def __init__(self, dataset: Any, on_fetch: Callable[[list], None] | None = None) -> None:
        self.dataset = dataset
        self.own = vars(dataset).get("__getitems__")  # one the program set on the instance itself
        self.on_fetch = on_fetch

    def __call__(self, indices: list) -> list:
        if self.own is not None:
            items = self.own(indices)
        elif callable(getattr(type(self.dataset), "__getitems__", None)):
            items = type(self.dataset).__getitems__(self.dataset, indices)
        else:
            items = [self.dataset[i] for i in indices]
        positions = [plain(i) for i in indices]
        if self.on_fetch is not None:
            self.on_fetch(positions)
            return items
        out = Positioned(items)
        out.positions = positions
        return out

    def remove(self) -> None:
        """Put the dataset back as it was."""
        if vars(self.dataset).get("__getitems__") is self:
            if self.own is not None:
                vars(self.dataset)["__getitems__"] = self.own
            else:
                del vars(self.dataset)["__getitems__"]


def tap_positions(loader: Any, on_fetch: Callable[[list], None] | None = None) -> tuple[PositionTap | None, str]:
    """Install a :class:`PositionTap` on the dataset of a training DataLoader: (the tap, what is read), or (None, why
    the positions cannot be read)."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        return None, f"the training loader ({type(loader).__name__}) has no dataset to take positions from"
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None, f"the training dataset ({type(dataset).__name__}) is iterable: its examples have no positions"
    if getattr(loader, "batch_sampler", None) is None:
        return None, "the training DataLoader batches nothing (batch_size=None): no sampler's batch to read"
    try:
        tap = PositionTap(dataset, on_fetch)
        vars(dataset)["__getitems__"] = tap
    except TypeError:  # vars() of an object without a __dict__ (a list, a class with __slots__)
        return None, (f"the training dataset ({type(dataset).__name__}) takes no attribute, so the positions its "
                      "DataLoader fetches cannot be read")
    return tap, POSITIONS_READ


def item_ids_or_positions(features: Any) -> tuple[list | None, IdKind]:
    """The ids of a fetch's items: each item's own ``id`` where every item has one, else their dataset positions
    (a :class:`Positioned` fetch), else None."""
    ids = ids_of(features)
    if ids is not None:
        return ids, IdKind.ITEM
    positions = getattr(features, "positions", None)
    return (list(positions), IdKind.POSITION) if positions is not None else (None, IdKind.ITEM)


def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> float | None:
    """The 2-norm of the gradients the optimizer is about to use (None when no parameter has one)."""
    grads = [p.grad.detach().float().norm() for p in parameters if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else None


UPDATE_STAGES = ("first_step", "steady_step")
# What a row says it left out when another stage opens inside an update stage (the framework's evaluation, its save).
EXCLUDED = {"eval": "evaluation", "save": "checkpoint save"}


class StageSpans:
    """``job.stage`` blocks that open in one framework hook and close in another (first_step: from the first
    update's start to its end). Each name is open at most once; whatever is still open at train end closes then.

    An update stage counts its updates (``update_done``: its row says how many and the time per update) and leaves
    out any other stage that opens inside it (an evaluation or a save between two of its updates: its time, its
    host samples and its allocator peaks are not the update stage's, and the row says what was excluded)."""

    def __init__(self, job) -> None:
        self.job = job
        self.open_spans: dict[str, contextlib.ExitStack] = {}
        self.handles: dict[str, Any] = {}
        self.paused: dict[str, list[tuple[str, str]]] = {}  # stage -> (update stage it paused, what it is)

    def open(self, name: str, inputs: dict | None = None, track: Iterable = (), excludes: str | None = None) -> None:
        """Open ``name``; ``excludes``: how an update stage's row names it when it opens inside one."""
        if name in self.open_spans:
            return
        if name not in UPDATE_STAGES:
            what = excludes or EXCLUDED.get(name, name)
            for other in UPDATE_STAGES:
                if other in self.open_spans:
                    self.handles[other].pause()
                    self.paused.setdefault(name, []).append((other, what))
        stack = contextlib.ExitStack()
        self.handles[name] = stack.enter_context(self.job.stage(name, inputs=inputs, track=tuple(track)))
        self.open_spans[name] = stack

    def close(self, name: str) -> None:
        stack = self.open_spans.pop(name, None)
        self.handles.pop(name, None)
        if stack is not None:
            stack.close()
        for other, what in self.paused.pop(name, []):
            if other in self.handles:
                self.handles[other].resume(what)

    def is_open(self, name: str) -> bool:
        return name in self.open_spans

    def update_done(self, updates_here: int) -> None:
        """After this process's ``updates_here``-th update: each open update stage counts it; first_step spans the
        first, steady_step the ``STEADY_UPDATES`` after it."""
        for name in UPDATE_STAGES:
            if name in self.handles:
                self.handles[name].update_done()
        if updates_here == 1:
            self.close("first_step")
        elif updates_here == 1 + STEADY_UPDATES:
            self.close("steady_step")

    def close_all(self) -> None:
        # The stages opened inside an update stage first, so it is resumed (and says what it left out) before it ends.
        for name in sorted(self.open_spans, key=lambda n: n in UPDATE_STAGES):
            self.close(name)


def private_collate(collate: Callable) -> Callable:
    """A deep copy of the program's collate for the probes: a collate with state of its own (an augmenting
    collator's ``random.Random``, a counter) must not advance in the control run only, or its updates stop matching
    the interrupted run's, which the resume gate then reports as an unseeded program. (The global RNGs are put back
    by ``rng_untouched``; this is the state that guard cannot see.)"""
    try:
        return copy.deepcopy(collate)
    except Exception as exc:  # an uncopyable member (a lock, an open file): the probes use the program's own
        warnings.warn(f"pilotrun: the collate {collate!r} cannot be copied ({type(exc).__name__}: {exc}); the probes "
                      "call the program's own, so any state of its own (a random generator) advances in the "
                      "control run only and the resume gate may report updates 1..N as not reproducible",
                      RuntimeWarning, stacklevel=2)
        return collate


# ------------------------------------------------------------------------------------------------------ the views


def built_from_config(model: torch.nn.Module) -> bool | None:
    """Whether the transformers model in ``model`` (itself, a peft wrapper's base, or a LightningModule's submodule)
    was built from a config, so randomly initialised: ``from_config``/``Model(config)`` leave
    ``config._name_or_path`` empty, ``from_pretrained`` sets it. None without a transformers config (cannot tell)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_name_or_path"):
            return not config._name_or_path
    return None


def framework_data(train: Any, val: Any, collate: Callable, decode: Callable | None = None,
                   label_names: list[str] | None = None) -> DataBundle:
    """A framework's examples as the checks read them (its own dataset and collate; no pilotrun task)."""
    return DataBundle(train=train, val=val if val is not None else train, collate=collate, decode=decode,
                      label_names=label_names)


class FrameworkUpdater:
    """The overfit copy's update inside a program: AdamW at the plan's constant lr on the framework's own loss."""

    def __init__(self, view: FrameworkView, model: torch.nn.Module, plan: OverfitPlan) -> None:
        self.view, self.model = view, model
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=plan.lr, weight_decay=0.0)

    def update(self, items: list, step: int) -> float:
        loss = self.view.loss(self.model, self.view.data.collate(items))
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteError("loss", step, value, [str(it.get("id", i)) if isinstance(it, dict) else str(i)
                                                       for i, it in enumerate(items)], " of the overfit copy")
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return value


class FrameworkView(ViewBase, abstract=True):
    """What every framework's view shares. Subclasses set ``framework``, ``data``, ``shift_labels``, ``targets_key``
    and implement ``model``, ``batching``, ``loss`` and the accumulation, export and reload methods of
    :class:`~pilotrun.gates.view.TrainingView` (one left out is a TypeError when the subclass is defined)."""

    requires_targets: bool = False  # a framework's batch need not follow pilotrun's factory contract
    scoring: str | None = None      # how the overfit subset was scored, when not one example at a time
    reference_note: str | None = None  # how outputs() ran the model, when not as the job holds it
    reference_dtype: torch.dtype | None = None  # the frameworks' outputs() compute with the weights as stored
    reference_device: str = "cpu"  # the integrations' outputs() run on (a copy moved to) the CPU
    scan_limit: int | None = SCAN_LIMIT
    targets_key: str | None = None
    shift_labels: bool = False
    data: DataBundle
    # Set by the callback from what it installed (tap_positions); a view built without one reads no positions.
    update_ids: UpdateIds = UpdateIds(False, "this view was built outside a callback, which reads them")

    @property
    @abstractmethod
    def model(self) -> torch.nn.Module: ...

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor: ...

    def model_copy(self, dtype: torch.dtype | None) -> tuple[torch.nn.Module, torch.device]:
        """A copy of the live model that shares nothing with it (``copying.own_copy``): where it is, or on the CPU in
        ``dtype`` (the float64 reference)."""
        from .copying import own_copy

        if dtype is None:
            copied = own_copy(self.model)
            return copied, next(copied.parameters()).device
        return own_copy(self.model).to("cpu").to(dtype), torch.device("cpu")

    @abstractmethod
    def batching(self) -> Batching: ...

    def progress(self, done: int, total: int, text: str) -> None:
        return None

    def inspect_limits(self) -> tuple[int, float]:
        # The first micro batch shown; the share of unsupervised examples that fails is the spec's default.
        return self.batching().micro_batch_size, InspectSpec().max_unsupervised_share

    def class_outputs(self) -> tuple[int | None, dict | None, str]:
        config = getattr(self.model, "config", None)
        id2label = {int(k): v for k, v in (getattr(config, "id2label", None) or {}).items()}
        if not id2label or all(v == f"LABEL_{k}" for k, v in id2label.items()):
            return None, None, "the model has no class names in its config"
        return len(id2label), id2label, "the model's config"

    def parameter_split(self) -> dict | None:
        split = parameter_split(self.model)
        return split.as_dict() if split.trainable_share < 1 else None

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def float64_problem(self) -> str | None:
        if getattr(self.model, "is_quantized", False) or getattr(self.model, "is_loaded_in_4bit", False):
            return "the quantised base has no float64 form: float32 copy"
        return None

    def declared_per_micro_batch(self) -> bool:
        return False

    def overfit_plan(self) -> OverfitPlan:
        return OVERFIT

    def overfit_items(self, n: int) -> list:
        return [self.data.train[i] for i in range(min(n, len(self.data.train)))]

    def overfit_updater(self, model: torch.nn.Module, plan: OverfitPlan) -> FrameworkUpdater:
        return FrameworkUpdater(self, model, plan)

    def target_scores(self, model: torch.nn.Module, items: list) -> tuple[float, float | None]:
        """The framework's own loss of each example alone, in eval mode (no accuracy: its outputs are its own)."""
        losses = self.item_losses(model, items)
        return sum(losses) / len(losses), None

    def item_losses(self, model: torch.nn.Module, items: list) -> list[float]:
        """The framework's own loss of each example alone, in eval mode.

        A loss that cannot take a batch of one (a ``.squeeze()`` that drops the batch dimension, found piloting a
        Lightning binary classifier) scores the subset as one batch instead, and ``scoring`` says so: a pass then
        cannot rule out targets that depend on their neighbours."""
        model.eval()
        try:
            with torch.no_grad():
                try:
                    losses = [float(self.loss(model, self.data.collate([it])).detach()) for it in items]
                except (RuntimeError, ValueError, IndexError) as exc:
                    self.scoring = (f"as one batch: the loss fails on a batch of one example ({type(exc).__name__}: "
                                    f"{(str(exc).splitlines() or [''])[0][:160]})")
                    losses = [float(self.loss(model, self.data.collate(items)).detach())]
        finally:
            model.train()
        return losses

    def random_base(self, model: torch.nn.Module) -> bool | None:
        return built_from_config(model)

    def control_items(self) -> list:
        val = self.data.val
        return [val[i] for i in range(min(self.batching().micro_batch_size, len(val)))]


def reload_pretrained(artifact: Artifact, batch, work: Path) -> Reloaded:
    """A fresh process loads a transformers export with its own ``from_pretrained`` (safetensors only, no remote
    code), admitted by pilotrun's loading policy against the manifest the export row recorded; its outputs on
    ``batch``."""
    from safetensors.torch import load_file, save_file

    from ..workers.launch import run_worker

    save_file(tensors_of(batch), str(work / "inputs.safetensors"))
    payload = run_worker("pilotrun.workers.reload",
                         ["--export", str(artifact.folder), "--inputs", str(work / "inputs.safetensors"),
                          "--outputs", str(work / "outputs.safetensors"),
                          "--known-manifest", str(artifact.manifest_sha256)],
                         work / "reload.json", work / "reload.log", "reload")
    return Reloaded(load_file(str(work / "outputs.safetensors"))["outputs"], payload["model_class"],
                    f"{payload['model_class']} (transformers from_pretrained)")


def record(job, gate: str, outcome: Outcome) -> Outcome:
    job.record_gate(gate, outcome.verdict, outcome.reason, **outcome.details)
    return outcome


def run_probes(job, view: TrainingView, export_folder: Path, observed: bool = False) -> dict[str, Outcome]:
    """Every gate the registry runs on a framework's view (``OnProgram.INTEGRATION``), in the pilot's order, each
    recorded as it finishes; ``observed``: the gates a hand-written loop's watcher records from its real steps
    (``Gate.watched``: batch, accum_equivalence) are left to it (:mod:`.observe`)."""
    site = ProbeSite(export_folder)
    for gate in GATES:
        if gate.on_program != OnProgram.INTEGRATION or (observed and gate.watched):
            continue
        outcome = run_check(gate.name, lambda check=gate.probe: check(view, site))  # type: ignore[misc]
        site.outcomes[gate.name] = record(job, gate.name, outcome)
    return site.outcomes
