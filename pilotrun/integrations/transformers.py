"""``PilotrunCallback`` for ``transformers.Trainer`` (and so TRL's ``SFTTrainer``): one line to be piloted.

    import pilotrun
    from pilotrun.integrations.transformers import PilotrunCallback

    job = pilotrun.program()
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[PilotrunCallback()])
    trainer.train(resume_from_checkpoint=job.resume_from)

Outside a pilot the handle is inert and the callback does nothing. Inside one it:

- reports every optimizer update: the loss (the sum of the window's micro-batch losses as ``training_step``
  returns them, i.e. the Trainer's own normalisation), the lr the optimizer stepped with (read after
  ``optimizer.step()``, before the scheduler's step, as the Trainer logs it), the gradient norm the Trainer
  computes and logs (before clipping: what ``accelerator.clip_grad_norm_`` returns) and the sample ids: each
  item's ``id`` field, read before the
  Trainer's collator (its ``RemoveColumnsCollator`` drops the column for a torch ``Dataset``; a
  ``datasets.Dataset`` loses it before any collator: keep it with ``remove_unused_columns=False`` and a collator
  that drops it, else updates carry no ids);
- measures ``first_step`` (the first update of this process), ``steady_step`` (the next ``STEADY_UPDATES``),
  ``eval`` and ``save`` (the Trainer's own evaluation and checkpoint) as stages;
- saves and stops where the pilot asks (``control.should_save``/``should_training_stop``), writes checkpoints
  into ``job.checkpoint_dir`` and reports each one (``job.saved``) after the Trainer wrote it;
- in the run whose rows the pilot records (the ``control`` run; also ``stages`` and ``probe``) runs inspect, batch,
  accum_equivalence, overfit, export and reload_eval at train begin on the trainer's own model, collator and loss
  (copies where they train, and a copy of the collator), with every RNG put back afterwards so the run still
  draws what the interrupted and resumed runs draw; a collator that gives different batches for the same examples
  (random masking) makes accum_equivalence ``skip``, an export without ``config.json`` (a plain ``nn.Module``)
  reload_eval; a ``probe`` run stops after one update.

Trainer callbacks are not given the trainer, so at ``on_train_begin`` the callback finds it in the calling frame
(the Trainer's own method that fires the event); ``PilotrunCallback(trainer=...)``/``bind()`` name it instead.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoint.export import safetensors_tensor_count
from ..checkpoint.io import AtomicFolder
from ..gates.accum import first_examples_window
from ..gates.base import Outcome
from ..gates.view import Artifact, Batching, Exported, NotMeasured, OverfitPlan, Reloaded, UpdateIds, Window, tensors_of
from ..program.describe import JobFacts, accelerator_compile, describe_objects, longest_collated
from ..program.env import IdKind
from ..train.evaluation import outputs_of
from ..train.loss import rng_untouched
from . import common as C
from .copying import class_forward, own_copy

# The keys the wrapped collate adds to a batch to carry its sample ids and what they are (the items' own or their
# dataset positions) to training_step (popped there, before the model sees the batch).
IDS_KEY = "__pilotrun_ids__"
IDS_KIND_KEY = "__pilotrun_ids_are__"


def _default_job():
    from ..program.handle import program

    return program()


def find_trainer() -> Trainer | None:
    """The Trainer whose method fired the current callback event: the nearest frame whose ``self`` is one."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


class PilotrunCallback(TrainerCallback):
    """See the module docstring. ``job``: a handle (default ``pilotrun.program()``); ``trainer``: the Trainer, when
    the callback should not look for it; ``probes=False``: no in-process gates (the pilot then shows them as skip)."""

    def __init__(self, job: Any = None, trainer: Trainer | None = None, probes: bool = True) -> None:
        self.job = job
        self.trainer = trainer
        self.probes = probes
        self.window = C.UpdateWindow()
        self.updates_here = 0
        self.pending_save = False
        self.spans: C.StageSpans | None = None
        self.probe_results: dict[str, Outcome] = {}
        self.tap: C.PositionTap | None = None
        self.update_ids = UpdateIds(False, "the callback found no train dataloader at train begin")

    def bind(self, trainer: Trainer) -> PilotrunCallback:
        self.trainer = trainer
        return self

    @property
    def active(self) -> bool:
        return bool(getattr(self.job, "active", False))

    # ------------------------------------------------------------------------------------------------ the hooks

    def on_train_begin(self, args, state, control, **kwargs):
        if self.job is None:
            self.job = _default_job()
        if not self.active:
            return
        trainer = self.trainer or find_trainer()
        if trainer is None:
            raise RuntimeError("pilotrun's PilotrunCallback found no transformers.Trainer calling it: add it to a "
                               "Trainer's callbacks, or name it with PilotrunCallback(trainer=trainer)")
        self.trainer = trainer
        self.spans = C.StageSpans(self.job)
        if self.job.checkpoint_dir:
            # Each role of the pilot writes its own checkpoints: the control never overwrites the interrupted run's.
            args.output_dir = str(self.job.checkpoint_dir)
        dataloader = kwargs.get("train_dataloader")
        self.collate = getattr(dataloader, "collate_fn", None) or trainer.data_collator
        if C.role_name(self.job) == "describe":  # the process ends in describe(): nothing after it runs
            self.job.describe(facts=lambda: describe_trainer(trainer, args, state, kwargs.get("optimizer"),
                                                             dataloader))
        if dataloader is not None:
            self._carry_ids(dataloader, trainer)
        if self.probes and C.runs_probes(self.job):
            with rng_untouched():  # the control run then draws what the runs without probes draw
                self.probe_results = run_probes(self.job, trainer, C.private_collate(self.collate), self.update_ids)

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.active or self.spans is None:
            return
        track = [m for m in (kwargs.get("model"), kwargs.get("optimizer")) if m is not None]
        if self.updates_here == 0:
            self.spans.open("first_step", {"update": state.global_step + 1, **self._inputs(args)}, track)
        elif self.updates_here == 1:
            self.spans.open("steady_step", {"updates": C.STEADY_UPDATES, **self._inputs(args)}, track)

    def on_optimizer_step(self, args, state, control, **kwargs):
        opt = kwargs.get("optimizer")
        if self.active and opt is not None:
            self.window.lr = float(opt.param_groups[0]["lr"])

    def on_step_end(self, args, state, control, **kwargs):
        if not self.active or self.spans is None:
            return
        update = state.global_step
        window, self.window = self.window, C.UpdateWindow()
        window.report(self.job, update, sum(window.losses) if window.losses else None)
        self.updates_here += 1
        self.spans.update_done(self.updates_here)
        # The Trainer's own schedule (save_steps, the end of training: DefaultFlowCallback ran first) is asked first,
        # so its saves are recorded as the program's own, not as ones pilotrun asked for.
        if not control.should_save and self.job.should_save(update):
            control.should_save = True
        if self.job.should_stop(update) or C.role_name(self.job) == "probe":
            control.should_training_stop = True
        self._open_eval_or_save(args, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.active and self.spans is not None:
            self._open_eval_or_save(args, control)

    def on_evaluate(self, args, state, control, **kwargs):
        if not self.active or self.spans is None:
            return
        self.spans.close("eval")
        metrics = kwargs.get("metrics") or {}
        if "eval_loss" in metrics and args.process_index == 0:
            self.job.evaluated(state.global_step, metrics["eval_loss"],
                               **{k.removeprefix("eval_"): v for k, v in metrics.items() if k != "eval_loss"})
        if self.pending_save:
            self.pending_save = False
            self.spans.open("save", {"update": state.global_step, **self._inputs(args)})

    def on_save(self, args, state, control, **kwargs):
        if not self.active or self.spans is None:
            return
        self.spans.close("save")
        path = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if path.is_dir() and args.process_index == 0:
            self.job.saved(state.global_step, str(path))

    def on_train_end(self, args, state, control, **kwargs):
        if self.spans is not None:
            self.spans.close_all()
        if self.tap is not None:
            self.tap.remove()
            self.tap = None

    # ------------------------------------------------------------------------------------------------ the parts

    def _inputs(self, args) -> dict:
        return {"micro_batch_size": args.per_device_train_batch_size,
                "grad_accum_steps": args.gradient_accumulation_steps, "world_size": args.world_size}

    def _open_eval_or_save(self, args, control) -> None:
        """The Trainer evaluates, then saves, right after on_step_end/on_epoch_end when control says so."""
        assert self.spans is not None
        if control.should_evaluate:
            self.pending_save = bool(control.should_save)
            self.spans.open("eval", self._inputs(args))
        elif control.should_save:
            self.spans.open("save", self._inputs(args))

    def _carry_ids(self, dataloader, trainer: Trainer) -> None:
        """Wrap the train dataloader's collate (ids in) and the trainer's training_step (ids out, loss recorded),
        and the accelerator's clip_grad_norm_ (the pre-clip norm the Trainer logs).

        The ids are each item's own ``id`` where the items carry one, else the items' positions in the training
        dataset: the indices the Trainer's sampler yielded (a ``RandomSampler``, accelerate's
        ``SeedableRandomSampler``, a ``LengthGroupedSampler``), read where the loader fetches them — after accelerate's
        ``BatchSamplerShard`` picked this process's share and after ``skip_first_batches`` skipped what a resumed
        epoch already trained — by a :class:`~pilotrun.integrations.common.PositionTap` on the loader's dataset (the
        Trainer iterates the loader after on_train_begin, so the first epoch's fetches go through it too)."""
        # accelerate's DataLoaderShard delegates to the torch DataLoader it wraps: the collate and dataset live there.
        loader = getattr(dataloader, "base_dataloader", dataloader)
        inner_collate = loader.collate_fn
        self.tap, how = C.tap_positions(loader)
        self.update_ids = UpdateIds(self.tap is not None, how)

        def collate(features):
            ids, kind = C.item_ids_or_positions(features)
            batch = inner_collate(list(features) if isinstance(features, C.Positioned) else features)
            if ids is not None and hasattr(batch, "__setitem__"):
                batch[IDS_KEY] = ids
                batch[IDS_KIND_KEY] = str(kind)
            return batch

        loader.collate_fn = collate
        inner_step = trainer.training_step
        window_of = self
        inner_clip = trainer.accelerator.clip_grad_norm_

        def clip_grad_norm_(parameters, max_norm, *rest, **kw):
            norm = inner_clip(parameters, max_norm, *rest, **kw)
            window_of.window.grad_norm = float(norm) if norm is not None else None
            return norm

        def training_step(model, inputs, num_items_in_batch=None, *rest, **kw):
            ids = inputs.pop(IDS_KEY, None) if hasattr(inputs, "pop") else None
            kind = IdKind(inputs.pop(IDS_KIND_KEY, IdKind.ITEM)) if hasattr(inputs, "pop") else IdKind.ITEM
            loss = inner_step(model, inputs, num_items_in_batch, *rest, **kw)
            window_of.window.add(float(loss.detach()) if isinstance(loss, torch.Tensor) else loss, ids, kind)
            return loss

        # Instance attributes, not the classes': only this trainer and this accelerator are wrapped.
        setattr(trainer, "training_step", training_step)  # noqa: B010
        setattr(trainer.accelerator, "clip_grad_norm_", clip_grad_norm_)  # noqa: B010


def describe_trainer(trainer: Trainer, args, state, optimizer, dataloader) -> JobFacts:
    """The job as the Trainer will run it: its model, the optimizer it built, TrainingArguments' batch, precision and
    checkpointing, and the length its collate produces for the longest training examples (TRL's ``max_length``
    where the examples cannot be read)."""
    loader = getattr(dataloader, "base_dataloader", dataloader)
    micro = int(args.per_device_train_batch_size)
    length, how = (None, "not measured: the Trainer has no train dataloader at train begin")
    if loader is not None:
        length, how = longest_collated(loader.dataset, loader.collate_fn, micro)
    declared = getattr(args, "max_length", None) or getattr(args, "max_seq_length", None)
    if length is None and isinstance(declared, int):
        length, how = declared, f"{type(args).__name__}.max_length (the examples could not be read: {how})"
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    assert trainer.model is not None  # the Trainer refuses to train without one
    scope, source = accelerator_compile(getattr(trainer, "accelerator", None))
    if getattr(args, "torch_compile", False):   # the Trainer compiles the model as it wraps it, after this call
        scope, source = scope or "model", f"TrainingArguments.torch_compile ({source or 'the whole model'})"
    facts = describe_objects(
        trainer.model, optimizer or trainer.optimizer, framework=f"{type(trainer).__module__}.{type(trainer).__name__}",
        micro_batch_size=micro, grad_accum_steps=int(args.gradient_accumulation_steps), precision=precision,
        precision_source="TrainingArguments." + ("bf16" if args.bf16 else "fp16") if precision else "",
        activation_checkpointing=True if args.gradient_checkpointing else None, max_length=length, length_source=how,
        world_size=int(args.world_size), updates=int(state.max_steps) if state.max_steps > 0 else None,
        max_grad_norm=float(args.max_grad_norm) if args.max_grad_norm else None, compile=scope, compile_source=source)
    if facts.precision is None:
        facts.precision, facts.precision_source = "fp32", "TrainingArguments: bf16 and fp16 off, fp32 parameters"
    facts.notes.append(f"TrainingArguments.optim: {getattr(args.optim, 'value', args.optim)}")
    return facts


# ------------------------------------------------------------------------------------------------------ the view


def _loss_scaled(trainer: Trainer, num_items) -> bool:
    """Whether ``training_step`` leaves the loss alone (already normalised over the window) or divides it by the
    window's micro-batch count — the rule of transformers' ``Trainer.training_step`` (5.x), mirrored."""
    declared = getattr(trainer, "loss_is_scaled_for_ga", None)
    if declared is not None:
        return bool(declared)
    return bool((trainer.model_accepts_loss_kwargs and num_items is not None) or trainer.compute_loss_func is not None)


def _loss(trainer: Trainer, model, batch, num_items=None) -> torch.Tensor:
    out = trainer.compute_loss(model, dict(batch), num_items_in_batch=num_items)
    return out if isinstance(out, torch.Tensor) else out[0]


def _trainer_backward(trainer: Trainer, model, batches: list) -> float:
    """One update's backward over ``batches`` as the Trainer computes it: its own num_items_in_batch count, its
    own compute_loss, its own accumulation scaling; the window's loss as the Trainer reports it."""
    _, num_items = trainer.get_batch_samples(iter(batches), len(batches), torch.device("cpu"))
    total = 0.0
    for batch in batches:
        loss = _loss(trainer, model, batch, num_items)
        if not _loss_scaled(trainer, num_items):
            loss = loss / len(batches)
        loss.backward()
        total += float(loss.detach())
    return total


TRAINER_FIX = ("make the model's forward accept num_items_in_batch (or **kwargs) and divide the summed token losses by "
               "it, or give the trainer a compute_loss_func that does")
# A Trainer subclass's own compute_loss gets the window's count as its num_items_in_batch argument.
OVERRIDE_FIX = ("{cls}.compute_loss overrides the Trainer's: sum its token losses and divide by its num_items_in_batch "
                "argument (the window's supervised tokens) instead of averaging the micro batch")


def preference_trainer(trainer: Trainer) -> bool:
    """A TRL preference trainer (DPO, and the others whose config has a beta and a loss_type): its batches pair a chosen
    with a rejected answer instead of carrying labels."""
    args = trainer.args
    return hasattr(args, "beta") and hasattr(args, "loss_type")


def pairwise_sigmoid(trainer: Trainer) -> bool:
    """A preference trainer whose loss is DPO's -log σ(β·margin) alone (TRL's ``DPOConfig`` default)."""
    args = trainer.args
    loss_type, weights = getattr(args, "loss_type", None), getattr(args, "loss_weights", None)
    return (hasattr(args, "beta") and isinstance(loss_type, (list, tuple)) and list(loss_type) == ["sigmoid"]
            and weights in (None, [1.0], (1.0,)) and not getattr(trainer, "aux_loss_enabled", False))


# DPO's loss is log 2 for a pair the model does not prefer either way and falls towards 0 only as the margin grows
# without bound (β·margin = 2.3 for a tenth of log 2): "a tenth of the starting loss" asks for more than memorising
# the pairs takes. Memorised is: every pair ranked right (its own loss below log 2) and the mean below half of it.
PAIRWISE_OVERFIT = dataclasses.replace(
    C.OVERFIT, loss_below=math.log(2) / 2, accuracy_at_least=1.0,
    loss_below_from="half of log 2, DPO's loss for a pair with no preference; each pair ranked right (below log 2)",
    accuracy_means="of the pairs ranked right (the chosen answer above the rejected one, relative to the reference "
                   "model)")


class TrainerView(C.FrameworkView):
    """A ``transformers.Trainer`` as the gates' checks read it (:class:`pilotrun.gates.view.TrainingView`): its
    datasets and (a private copy of) its collator, its ``compute_loss`` with its own ``num_items_in_batch`` and
    accumulation scaling, ``save_model`` and ``from_pretrained``."""

    framework = "Trainer.compute_loss with its num_items_in_batch and accumulation scaling"
    targets_key: str | None = "labels"

    def __init__(self, trainer: Trainer, collate, update_ids: UpdateIds | None = None) -> None:
        self.trainer = trainer
        if preference_trainer(trainer):
            # A preference trainer's batch holds the chosen and rejected answers, and its loss compares them: there is
            # no 'labels' field to read, and no reason to warn that there is none.
            self.targets_key = None
        if update_ids is not None:
            self.update_ids = update_ids
        decode = getattr(trainer.processing_class, "decode", None)
        self.data = C.framework_data(trainer.train_dataset, trainer.eval_dataset, collate, decode)
        self.shift_labels = bool(getattr(trainer, "_loss_shifts_labels", False))

    @property
    def model(self) -> torch.nn.Module:
        if self.trainer.model is None:
            raise RuntimeError("the Trainer has no model")
        return self.trainer.model

    def loss(self, model, batch) -> torch.Tensor:
        return _loss(self.trainer, model, batch)

    def batching(self) -> Batching:
        trainer, args = self.trainer, self.trainer.args
        kwargs = bool(trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None)
        how = ("num_items_in_batch: the model takes loss kwargs, so every token of the window weighs the same" if kwargs
               else "each micro batch's own mean divided by the window's micro-batch count (the model takes no "
                    "num_items_in_batch): see accum_equivalence")
        short = ("a mean over its own supervised tokens (the Trainer counts the window's own num_items_in_batch)"
                 if kwargs else "each micro batch's mean divided by its own micro-batch count (the Trainer's)")
        return Batching(args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size,
                        len(self.data.train), drop_last=bool(args.dataloader_drop_last), short_window=short,
                        normalisation=how, planned=("max_steps", args.max_steps) if args.max_steps > 0 else None,
                        accum_setting="gradient_accumulation_steps")

    def accum_windows(self) -> list[Window]:
        b = self.batching()
        return first_examples_window(self.data, b.micro_batch_size, b.grad_accum_steps, self.shift_labels)

    def accumulate(self, model, micro: list, device) -> float:
        return _trainer_backward(self.trainer, model, [batch for _, batch in micro])

    def one_batch(self, model, batch, device) -> float:
        return _trainer_backward(self.trainer, model, [batch])

    def normalisation_cause(self, counts: list[int], sizes: list[int]) -> str | None:
        if len(set(counts)) <= 1:
            return None
        fix = (OVERRIDE_FIX.format(cls=type(self.trainer).__name__)
               if type(self.trainer).compute_loss is not Trainer.compute_loss else TRAINER_FIX)
        return ("the loss is averaged per micro batch, so tokens of micro batches with fewer supervised labels weigh "
                f"more than in one big batch (transformers#37766): {fix}")

    def scale_cause(self, scale: float, micro_batches: int) -> str | None:
        """An exact factor between the Trainer's window and one batch: the loss ignores the ``num_items_in_batch`` the
        Trainer gives it (issue 44: BERT classification, exactly 2.0x at accumulation 2)."""
        trainer = self.trainer
        if not _loss_scaled(trainer, 1) or abs(scale - micro_batches) > 1e-3 * micro_batches:
            return None
        if type(trainer).compute_loss is not Trainer.compute_loss:
            fix = OVERRIDE_FIX.format(cls=type(trainer).__name__)
        elif trainer.compute_loss_func is not None:
            fix = ("the Trainer's compute_loss_func is given num_items_in_batch: sum the token losses and divide by it "
                   "instead of averaging the micro batch")
        else:
            fix = (f"set {type(self.model).__name__}.accepts_loss_kwargs = False (the Trainer then divides each micro "
                   "batch's loss by gradient_accumulation_steps), or give the Trainer a compute_loss_func that sums "
                   "the losses and divides by num_items_in_batch")
        return (f"the accumulated gradient is exactly {scale:.4g}x the one-batch gradient: the loss normalisation. "
                "The Trainer passes the window's num_items_in_batch and leaves the division to the loss (the model "
                f"takes loss kwargs), but the loss ignores it and averages its own micro batch, so the {micro_batches} "
                f"micro-batch means are added up: {fix}")

    def export(self, folder: Path) -> Exported:
        """``trainer.save_model`` (the framework's own save) into an atomic folder whose manifest pilotrun records."""
        if self.trainer.is_fsdp_enabled or self.trainer.is_deepspeed_enabled:
            raise NotMeasured("under FSDP or DeepSpeed trainer.save_model gathers the shards with a collective every "
                              "process must join, and the probe runs on rank 0 alone; pilot the export with one "
                              "process")
        with AtomicFolder(folder, "export", {"written_by": "transformers.Trainer.save_model"}) as out:
            self.trainer.save_model(str(out.tmp))
            out.adopt_existing()
        weights = sorted(f for f in out.files if f.endswith(".safetensors"))
        return Exported(folder, out.files, out.total_bytes, str(out.manifest_sha256), weights,
                        tensors=safetensors_tensor_count(folder) if weights else None,
                        written_by="trainer.save_model",
                        note="training_args.bin, a pickle, is never read back")

    def control_items(self) -> list:
        val = self.data.val
        return [val[i] for i in range(min(self.trainer.args.per_device_eval_batch_size, len(val)))]

    def overfit_plan(self) -> OverfitPlan:
        return PAIRWISE_OVERFIT if pairwise_sigmoid(self.trainer) else C.OVERFIT

    def target_scores(self, model: torch.nn.Module, items: list) -> tuple[float, float | None]:
        losses = self.item_losses(model, items)
        ranked = (sum(x < math.log(2) for x in losses) / len(losses)
                  if pairwise_sigmoid(self.trainer) and self.scoring is None else None)
        return sum(losses) / len(losses), ranked

    def outputs(self, batch) -> torch.Tensor:
        """The live model itself (no copy: TRL's forward closes over the original), its class's forward in eval mode,
        every random stream and train flag as they were."""
        model = self.model
        if next(model.parameters()).device.type != "cpu":
            # The reload runs on the CPU: another device's kernels (TF32, bf16) differ by more than the tolerance.
            model = own_copy(model).to("cpu")
        with rng_untouched(), class_forward(model) as patched:
            out = outputs_of(model, tensors_of(batch))
        if patched:
            amp = getattr(self.trainer.accelerator, "mixed_precision", "no")
            self.reference_note = ("compared with the model's class forward in its weights' precision, as the reload "
                                   "runs it: the forward wrappers set on "
                                   f"{', '.join(n or type(model).__name__ for n in patched)} for training "
                                   + (f"(accelerate's {amp} autocast among them) " if amp in ("bf16", "fp16") else "")
                                   + "are not part of the artifact")
        return out

    def export_state(self) -> dict[str, torch.Tensor] | None:
        from ..gates.reload_eval import export_state_of

        return export_state_of(self.trainer.accelerator.unwrap_model(self.model))

    def reload_problem(self, artifact: Artifact) -> str | None:
        if (artifact.folder / "config.json").is_file():
            return None
        # save_model of a plain nn.Module (or an adapter alone) writes weights without the config from_pretrained
        # needs: the reload would fail on pilotrun's side, not on a defect of the program.
        kind = type(self.trainer.accelerator.unwrap_model(self.model)).__name__
        return (f"not measured: the export has no config.json ({kind} is not a transformers PreTrainedModel), so "
                "from_pretrained cannot rebuild it in a fresh process; a PreTrainedModel with a config gets its "
                "reload checked")

    def reload(self, artifact: Artifact, batch, work: Path) -> Reloaded:
        return C.reload_pretrained(artifact, batch, work)


def run_probes(job, trainer: Trainer, collate, update_ids: UpdateIds | None = None) -> dict[str, Outcome]:
    """Every in-process gate on the trainer, in the pilot's order, each recorded as it finishes."""
    root = Path(job.checkpoint_dir or trainer.args.output_dir or ".")
    with _bookkeeping_kept(trainer):
        return C.run_probes(job, TrainerView(trainer, collate, update_ids), root / "pilotrun-export")


# What a trainer's compute_loss counts as it goes (TRL: its logged entropy, token accuracy and token count): the
# probes' forwards must not show up in the program's own logs.
_BOOKKEEPING = ("_metrics", "_total_train_tokens")


@contextlib.contextmanager
def _bookkeeping_kept(trainer: Trainer):
    saved = {k: copy.deepcopy(vars(trainer)[k]) for k in _BOOKKEEPING if k in vars(trainer)}
    tokens_seen = trainer.state.num_input_tokens_seen
    # The probes run on rank 0 alone, and TRL's compute_loss gathers its metrics from every rank: a collective the
    # other ranks never join. What it gathers is thrown away (above), so rank 0's own values stand in.
    accelerator = getattr(trainer, "accelerator", None)
    gathers = {k: vars(accelerator).get(k) for k in _GATHERS} if accelerator is not None else {}
    for k in gathers:
        setattr(accelerator, k, _own_values)
    try:
        yield
    finally:
        vars(trainer).update(saved)
        trainer.state.num_input_tokens_seen = tokens_seen
        for k, before in gathers.items():
            if before is None:
                vars(accelerator).pop(k, None)
            else:
                setattr(accelerator, k, before)


_GATHERS = ("gather", "gather_for_metrics")


def _own_values(tensor, *args, **kwargs):
    return tensor
