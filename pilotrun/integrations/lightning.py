"""``PilotrunCallback`` for Lightning 2.x: one line to be piloted.

    import pilotrun
    from pilotrun.integrations.lightning import PilotrunCallback

    job = pilotrun.program()
    trainer = L.Trainer(max_steps=..., callbacks=[PilotrunCallback()])
    trainer.fit(module, train_loader, ckpt_path=job.resume_from)

Outside a pilot the handle is inert and the callback does nothing. Inside one it:

- reports every optimizer update (``trainer.global_step``): the loss (the mean of the window's micro-batch losses
  as ``training_step`` returned them), the lr the optimizer steps with and the 2-norm of the accumulated gradients
  before Lightning clips them (both read in ``on_before_optimizer_step``), and the sample ids: the batch's ``id``
  field where the collate keeps one, else the examples' positions in the training dataset (the indices its
  DataLoader's sampler yielded, read where the loader fetches them; with ``num_workers=0``);
- measures ``first_step``, ``steady_step`` (the next ``STEADY_UPDATES`` updates), ``eval`` (validation, not the
  sanity check) and ``save`` as stages;
- saves where the pilot asks with ``trainer.save_checkpoint`` into ``job.checkpoint_dir`` (``step-<N>.ckpt``) and
  reports it, stops with ``trainer.should_stop``;
- in the run whose rows the pilot records (``control``; also ``stages`` and ``probe``), with every RNG put back
  afterwards, runs inspect, batch, accum_equivalence (``training_step``'s loss with Lightning's own
  accumulation scaling, loss / accumulate_grad_batches), overfit, export (``trainer.save_checkpoint``) and
  reload_eval (a fresh process: ``load_from_checkpoint(weights_only=True)`` of the class, after pilotrun's loading
  policy admitted the recorded manifest) at train start, on copies of the module (reading the fit's trainer
  through a :class:`TrainerView`, logging nothing) and of the collate (its own
  random generator, if any, does not advance); a collate that gives different batches for the same examples
  makes accum_equivalence ``skip``; a ``probe`` run stops after one update.

Lightning is an optional extra: this module says how to install it when it is missing; ``import pilotrun`` never
imports it.
"""
from __future__ import annotations

import contextlib
import inspect
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.io import AtomicFolder
from ..gates.accum import first_examples_window
from ..gates.base import Outcome
from ..gates.view import Artifact, Batching, Exported, NotMeasured, Reloaded, UpdateIds, Window, tensors_of
from ..program.describe import LIGHTNING_PRECISION, JobFacts, describe_objects, longest_collated
from ..program.env import IdKind
from ..train.loss import rng_untouched
from . import common as C
from .copying import own_copy

try:
    import lightning.pytorch as pl
except ImportError as exc:  # the optional extra is not installed
    raise ImportError("pilotrun.integrations.lightning needs Lightning 2.x, which is not installed: "
                      "pip install 'pilotrun[lightning]' (or pip install lightning)") from exc

CHECKPOINT = "model.ckpt"


def _default_job():
    from ..program.handle import program

    return program()


def step_loss(output: Any) -> torch.Tensor | None:
    """The loss a ``training_step`` returned (a tensor, or a mapping with ``loss``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return None


class PilotrunCallback(pl.Callback):
    """See the module docstring. ``job``: a handle (default ``pilotrun.program()``); ``probes=False``: no in-process
    gates (the pilot then shows them as skip)."""

    def __init__(self, job: Any = None, probes: bool = True) -> None:
        self.job = job
        self.probes = probes
        self.window = C.UpdateWindow()
        self.updates_here = 0
        self.last_step: int | None = None
        self.spans: C.StageSpans | None = None
        self.probe_results: dict[str, Outcome] = {}
        self.reported_step = -1  # the last update whose checkpoint job.saved was told of
        self.tap: C.PositionTap | None = None
        self.fetched: deque[list] = deque()  # the positions of each training fetch, oldest first
        self.validating = False
        self.update_ids = UpdateIds(False, "the callback has not started")

    @property
    def active(self) -> bool:
        return bool(getattr(self.job, "active", False))

    def _tap_positions(self, trainer) -> UpdateIds:
        """Read the dataset positions of every training fetch (:class:`~pilotrun.integrations.common.PositionTap`),
        in this process: Lightning created the epoch's iterator before on_train_start, so a collate wrapped now
        would not be the one it calls; the dataset is looked up at every fetch."""
        loader = trainer.train_dataloader
        if not isinstance(loader, torch.utils.data.DataLoader):
            return UpdateIds(False, f"the train dataloaders are a {type(loader).__name__}, not one DataLoader")
        if loader.num_workers > 0:
            return UpdateIds(False, f"the train DataLoader fetches in {loader.num_workers} worker processes, whose "
                                    "positions do not reach this one; with num_workers=0 they are read")
        try:
            len(loader)
        except TypeError:
            return UpdateIds(False, "the train DataLoader has no length, so Lightning fetched a batch ahead before "
                                    "the callback started")
        self.tap, how = C.tap_positions(loader, self._fetched)
        return UpdateIds(self.tap is not None, how)

    def _fetched(self, positions: list) -> None:
        if not self.validating:  # a validation loader over the same dataset object fetches through the tap too
            self.fetched.append(positions)

    def _inputs(self, trainer) -> dict:
        loader = trainer.train_dataloader
        return {"micro_batch_size": getattr(loader, "batch_size", None),
                "grad_accum_steps": trainer.accumulate_grad_batches, "world_size": trainer.world_size}

    def on_train_start(self, trainer, pl_module) -> None:
        if self.job is None:
            self.job = _default_job()
        if not self.active:
            return
        if C.role_name(self.job) == "describe":  # the process ends in describe(): nothing after it runs
            self.job.describe(facts=lambda: describe_fit(trainer, pl_module))
        self.spans = C.StageSpans(self.job)
        self.last_step = trainer.global_step
        self.update_ids = self._tap_positions(trainer)
        if self.probes and C.runs_probes(self.job):
            with rng_untouched():  # the control run then draws what the runs without probes draw
                self.probe_results = run_probes(self.job, trainer, pl_module, self.update_ids)

    def _report_own_saves(self, trainer) -> None:
        """The fit's own checkpoints (its ModelCheckpoint callbacks: every_n_train_steps, epoch end), told to the
        handle once written — so ``pilot.resume.before: auto`` proves the resume at the program's own checkpoint.
        ModelCheckpoint runs after this callback within a hook, so its save is seen at the next one."""
        if not self.active:
            return
        for cb in trainer.checkpoint_callbacks:
            step, path = getattr(cb, "_last_global_step_saved", 0), getattr(cb, "_last_checkpoint_saved", "")
            if step > self.reported_step and path and Path(path).is_file():
                self.reported_step = step
                if trainer.is_global_zero:
                    self.job.saved(step, str(path))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._report_own_saves(trainer)
        if not self.active or self.spans is None:
            return
        if not self.window.losses:  # the first micro batch of an update window
            track = [pl_module, *trainer.optimizers]
            if self.updates_here == 0:
                self.spans.open("first_step", {"update": trainer.global_step + 1, **self._inputs(trainer)}, track)
            elif self.updates_here == 1:
                self.spans.open("steady_step", {"updates": C.STEADY_UPDATES, **self._inputs(trainer)}, track)
        # The fetch that made this batch (every fetch is popped, so the next batch reads its own).
        positions = self.fetched.popleft() if self.fetched else None
        ids = C.ids_of(batch)
        self.window.add_ids(*((ids, IdKind.ITEM) if ids is not None else (positions, IdKind.POSITION)))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.active:
            self.window.lr = float(optimizer.param_groups[0]["lr"])
            self.window.grad_norm = C.grad_norm(pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.active or self.spans is None:
            return
        loss = step_loss(outputs)
        self.window.losses.append(float(loss.detach()) if loss is not None else float("nan"))
        update = trainer.global_step
        if update == self.last_step:  # still accumulating
            return
        self.last_step = update
        window, self.window = self.window, C.UpdateWindow()
        window.report(self.job, update, sum(window.losses) / len(window.losses))
        self.updates_here += 1
        self.spans.update_done(self.updates_here)
        if self.job.should_save(update):
            folder = Path(self.job.checkpoint_dir or trainer.default_root_dir)
            path = folder / f"step-{update}.ckpt"
            self.spans.open("save", {"update": update, **self._inputs(trainer)})
            trainer.save_checkpoint(path)
            self.spans.close("save")
            self.reported_step = max(self.reported_step, update)
            if trainer.is_global_zero:
                self.job.saved(update, str(path))
        if self.job.should_stop(update) or C.role_name(self.job) == "probe":
            trainer.should_stop = True

    def on_validation_start(self, trainer, pl_module) -> None:
        self.validating = True
        if self.active and self.spans is not None and not trainer.sanity_checking:
            # Inside a training stage (val_check_interval within steady_step's updates) it is left out of it.
            self.spans.open("eval", self._inputs(trainer), excludes="validation")

    def on_validation_end(self, trainer, pl_module) -> None:
        self.validating = False
        if self.spans is not None:
            self.spans.close("eval")
        loss = trainer.callback_metrics.get("val_loss")
        if self.active and loss is not None and not trainer.sanity_checking and trainer.is_global_zero:
            self.job.evaluated(trainer.global_step, loss, **{k.removeprefix("val_"): v for k, v in
                                                             trainer.callback_metrics.items() if k.startswith("val_")
                                                             and k != "val_loss"})

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._report_own_saves(trainer)
        # A fetch no batch came from (an epoch cut short) must not name the next epoch's first batch.
        self.fetched.clear()

    def on_train_end(self, trainer, pl_module) -> None:
        self._report_own_saves(trainer)
        if self.spans is not None:
            self.spans.close_all()
        if self.tap is not None:
            self.tap.remove()
            self.tap = None


# ------------------------------------------------------------------------------------------------------ probes


class TrainerView:
    """What a probe's copy of the module sees as ``self.trainer``: the fit's trainer for reading (a training_step
    may read ``self.trainer.accumulate_grad_batches``, ``self.lr_schedulers()``, ``self.global_step``); an attribute
    the copy sets stays on the view, never on the fit's trainer."""

    def __init__(self, trainer: Any) -> None:
        object.__setattr__(self, "_fit_trainer", trainer)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_fit_trainer"), name)


def _no_log(*args: Any, **kwargs: Any) -> None:
    """The copy's ``self.log``/``self.log_dict``: a probe's values never reach the fit's logged metrics."""


def detached_copy(module: pl.LightningModule, dtype: torch.dtype | None = None,
                  view_of: Any = None) -> pl.LightningModule:
    """A deep copy of the module without its trainer (copying the trainer would copy the whole fit); with
    ``view_of``, the copy reads that trainer through a :class:`TrainerView` (a training_step that reads its trainer
    made every probe fail with "not attached to a `Trainer`") and logs nothing."""
    trainer, module._trainer = module._trainer, None
    try:
        out = own_copy(module).to("cpu")
    finally:
        module._trainer = trainer
    if view_of is not None:
        # The setter gives nested LightningModules the view too; a view, not a Trainer, hence the ignores.
        out.trainer = TrainerView(view_of)  # type: ignore[assignment]
        for child in out.modules():
            if isinstance(child, pl.LightningModule):
                child.log, child.log_dict = _no_log, _no_log  # type: ignore[method-assign]
    return out.to(dtype) if dtype is not None else out


def _loss(module, batch, idx: int = 0) -> torch.Tensor:
    loss = step_loss(module.training_step(batch, idx))
    if loss is None:
        raise RuntimeError("training_step returned no loss (a tensor or a mapping with 'loss'): automatic "
                           "optimization needs one")
    return loss


def _loader_parts(trainer) -> tuple[Any, Callable, int]:
    loader = trainer.train_dataloader
    if loader is None or not hasattr(loader, "dataset"):
        raise RuntimeError("the trainer has no map-style train dataloader to take examples from")
    # A DataLoader built with batch_sampler= has batch_size None: the micro batch size is the sampler's (a bucketing
    # sampler without one: its first batch's). Read as 1, the batch row had 4x too many updates per epoch.
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    if size is None:
        size = len(next(iter(loader.batch_sampler)))
    # A private copy: a collate with its own state (a random generator) must not advance in the control run only.
    return loader.dataset, C.private_collate(loader.collate_fn), int(size)


def describe_fit(trainer, module) -> JobFacts:
    """The job as the fit will run it: the module (the transformers model inside it, when it holds one and nothing
    else trainable), its optimizer, the Trainer's precision, accumulation and devices, the loader's micro batch and
    the length its collate produces for the longest training examples."""
    precision = LIGHTNING_PRECISION.get(str(trainer.precision))
    try:
        dataset, collate, micro = _loader_parts(trainer)
        length, how = longest_collated(dataset, collate, micro)
    except (RuntimeError, StopIteration, TypeError) as exc:
        micro, length, how = None, None, f"not measured: {exc}"
    updates = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
    if updates is None:
        with contextlib.suppress(Exception):  # an unsized loader without max_steps: the fit itself cannot say
            updates = int(trainer.estimated_stepping_batches)
    clip = trainer.gradient_clip_val
    facts = describe_objects(
        module, trainer.optimizers[0] if trainer.optimizers else None, framework="lightning.Trainer",
        micro_batch_size=micro, grad_accum_steps=int(trainer.accumulate_grad_batches), precision=precision,
        precision_source=f"Trainer(precision={trainer.precision!r})" if precision else "", max_length=length,
        length_source=how, world_size=int(trainer.world_size), updates=updates,
        max_grad_norm=float(clip) if clip else None)
    if precision is None:
        facts.notes.append(f"Trainer(precision={trainer.precision!r}) has no train.precision equivalent")
    if facts.compile is not None:   # trainer.fit(torch.compile(module)): Lightning marks the module it unwrapped
        facts.compile_source = "the LightningModule runs torch.compile'd (Lightning's _compiler_ctx)"
    if len(trainer.optimizers) > 1:
        facts.notes.append(f"the fit has {len(trainer.optimizers)} optimizers; the first is described")
    return facts


# Lightning passes no token count: training_step must weigh its micro batch by the window's labels itself.
LIGHTNING_FIX = ("Lightning divides each training_step loss by accumulate_grad_batches and passes no token count, "
                 "so return the micro batch's summed token losses × accumulate_grad_batches / the supervised tokens "
                 "of the whole accumulation window (count them where the batches are built), or average over "
                 "examples instead of tokens")


class LightningView(C.FrameworkView):
    """A Lightning fit as the gates' checks read it (:class:`pilotrun.gates.view.TrainingView`): its train
    dataloader's dataset and (a private copy of) its collate, the module's ``training_step`` with Lightning's own
    ``loss / accumulate_grad_batches``, ``save_checkpoint`` and ``load_from_checkpoint`` — on copies of the module
    that read the fit's trainer through a :class:`TrainerView` and log nothing."""

    framework = "LightningModule.training_step with Lightning's loss / accumulate_grad_batches"
    targets_key: str | None = None  # training_step reads whatever fields it wants

    def __init__(self, trainer, module: pl.LightningModule, update_ids: UpdateIds | None = None) -> None:
        self.trainer, self.module = trainer, module
        if update_ids is not None:
            self.update_ids = update_ids
        dataset, collate, self.size = _loader_parts(trainer)
        self.data = C.framework_data(dataset, None, collate)

    @property
    def model(self) -> torch.nn.Module:
        return self.module

    def loss(self, model, batch) -> torch.Tensor:
        return _loss(model, batch)

    def batching(self) -> Batching:
        trainer = self.trainer
        accum = int(trainer.accumulate_grad_batches)
        # The loader's own length: its sampler's count per process (drop_last, a batch_sampler, Lightning's
        # DistributedSampler), not arithmetic on batch_size.
        return Batching(self.size, accum, int(trainer.world_size), len(self.data.train),
                        micro_batches_per_epoch=len(trainer.train_dataloader),
                        short_window="each micro batch's loss / accumulate_grad_batches (Lightning)",
                        normalisation="each micro batch's loss / accumulate_grad_batches (Lightning)",
                        planned=("max_steps", int(steps)) if (steps := getattr(trainer, "max_steps", None) or 0) > 0
                        else None, accum_setting="accumulate_grad_batches")

    def accum_windows(self) -> list[Window]:
        return first_examples_window(self.data, self.size, int(self.trainer.accumulate_grad_batches), False)

    def model_copy(self, dtype):
        return detached_copy(self.module, dtype, view_of=self.trainer), torch.device("cpu")

    def accumulate(self, model, micro: list, device) -> float:
        total = 0.0
        for i, (_, batch) in enumerate(micro):
            # Lightning's automatic optimization divides each micro batch's loss by accumulate_grad_batches
            # (loops/optimization/automatic.py, ClosureResult.from_training_step_output).
            loss = _loss(model, batch, i) / len(micro)
            loss.backward()
            total += float(loss.detach())
        return total

    def one_batch(self, model, batch, device) -> float:
        loss = _loss(model, batch)
        loss.backward()
        return float(loss.detach())

    def normalisation_cause(self, counts: list[int], sizes: list[int]) -> str | None:
        if len(set(counts)) <= 1:
            return None
        return ("the loss is averaged per micro batch, so tokens of micro batches with fewer supervised labels weigh "
                f"more than in one big batch: {LIGHTNING_FIX}")

    def export(self, folder: Path) -> Exported:
        if self.trainer.world_size > 1:
            raise NotMeasured("with several processes Lightning's save_checkpoint is collective (a barrier every "
                              "process must reach) and the probe runs on rank 0 alone; pilot the export with one "
                              "process")
        with AtomicFolder(folder, "export", {"written_by": "lightning Trainer.save_checkpoint"}) as out:
            self.trainer.save_checkpoint(out.tmp / CHECKPOINT, weights_only=True)
            out.adopt_existing()
        return Exported(folder, out.files, out.total_bytes, str(out.manifest_sha256), [CHECKPOINT],
                        weights_format="Lightning checkpoint", written_by="trainer.save_checkpoint")

    def outputs(self, batch) -> torch.Tensor:
        model = detached_copy(self.module).eval()  # as the fresh process has it: no trainer
        try:
            with torch.no_grad():
                return _loss(model, batch).detach().float().reshape(1)
        except Exception as exc:  # training_step needs its trainer (or the fit's state): the reload cannot run it
            raise NotMeasured(f"not measured: {type(self.module).__qualname__}.training_step fails without its "
                              f"Trainer ({type(exc).__name__}: {str(exc)[:200]}), and the fresh process that loads "
                              "the checkpoint has none; a training_step that reads nothing from self.trainer gets its "
                              "reload checked") from None

    def reload_problem(self, artifact: Artifact) -> str | None:
        cls = type(self.module)
        if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
            return (f"{cls.__qualname__} is defined in the program's own script (or inside a function): a fresh "
                    "process cannot build it without running the program again; define the LightningModule in an "
                    "importable module to enable reload_eval")
        return None

    def export_state(self) -> dict[str, torch.Tensor] | None:
        return None  # the export is a Lightning checkpoint (a pickle), not safetensors the gate reads tensor by tensor

    def reload(self, artifact: Artifact, batch, work: Path) -> Reloaded:
        """A fresh process: ``load_from_checkpoint(weights_only=True)`` of the class, after pilotrun's loading policy
        admitted the recorded manifest; its ``training_step`` loss on the same batch, in eval mode."""
        from safetensors.torch import load_file, save_file

        from ..workers.launch import run_worker

        cls = type(self.module)
        save_file(tensors_of(batch), str(work / "inputs.safetensors"))
        where = str(Path(inspect.getfile(cls)).resolve().parent)
        run_worker("pilotrun.integrations.lightning_reload",
                   ["--export", str(artifact.folder), "--known-manifest", str(artifact.manifest_sha256),
                    "--module-class", f"{cls.__module__}:{cls.__qualname__}", "--module-folder", where,
                    "--batch-kind", "dict" if isinstance(batch, Mapping) else "tuple",
                    "--inputs", str(work / "inputs.safetensors"), "--outputs", str(work / "outputs.safetensors")],
                   work / "reload.json", work / "reload.log", "reload")
        return Reloaded(load_file(str(work / "outputs.safetensors"))["outputs"], cls.__qualname__,
                        f"{cls.__qualname__} checkpoint (its training_step loss, eval mode)")


def run_probes(job, trainer, module, update_ids: UpdateIds | None = None) -> dict[str, Outcome]:
    """Every in-process gate on the fit, in the pilot's order, each recorded as it finishes."""
    root = Path(job.checkpoint_dir or trainer.default_root_dir)
    return C.run_probes(job, LightningView(trainer, module, update_ids), root / "pilotrun-export")
