"""An ``accelerate`` training loop, piloted: one call after ``Accelerator.prepare``.

    import pilotrun
    from pilotrun.integrations.accelerate import begin

    job = pilotrun.program()
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    begin(job, accelerator, model, optimizer, loader, updates=args.updates)   # pilotrun
    ...  # the loop reports with job.update / job.saved / job.should_stop as any program does

Outside a pilot it does nothing. In the ``describe`` run it describes the job (the model, the optimizer the loop
built, ``gradient_accumulation_steps``, ``mixed_precision``, the loader's micro batch and the length its collate
gives the longest training examples) and the process ends there. On rank 0 of the run whose rows the pilot records
it runs the probe gates — inspect, batch, accum_equivalence, overfit, export, reload_eval — on copies of the
prepared model with the loader's own dataset and collate, the loss as the loop computes it (``loss(model, batch)``,
default ``model(**batch).loss``) and ``accelerator.backward``'s division by ``gradient_accumulation_steps``; every
RNG is put back afterwards, so the run still draws what the interrupted and resumed runs draw.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..gates.accum import first_examples_window
from ..gates.base import Outcome
from ..gates.view import Batching, Exported, NotMeasured, UpdateIds, Window
from ..program.describe import JobFacts, accelerator_compile, compile_seen, describe_objects, longest_collated
from . import common as C
from .loops import HandLoopView
from .observe import probe_and_watch

MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16"}  # accelerate's mixed_precision -> train.precision ("no": weights)

ACCELERATE_FIX = ("accelerator.backward divides each micro batch's mean loss by gradient_accumulation_steps, so "
                  "tokens of micro batches with fewer supervised labels weigh more than in one big batch: count the "
                  "window's supervised tokens before its micro batches and divide each one's summed token losses by "
                  "them (times gradient_accumulation_steps), or average over examples instead of tokens")


def _default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    out = model(**batch)
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None:
        raise TypeError(f"{type(model).__name__}(**batch) returned no loss: pass loss=lambda model, batch: ... to "
                        "begin() (the loss as the loop computes it)")
    return loss


def _base_loader(loader: Any) -> Any:
    """The torch DataLoader under accelerate's DataLoaderShard/DataLoaderDispatcher."""
    return getattr(loader, "base_dataloader", loader)


def _micro_batch(loader: Any, accelerator: Any = None) -> int:
    """Examples per forward on one process. With ``split_batches`` accelerate splits the loader's batch over the
    processes."""
    base = _base_loader(loader)
    size = base.batch_size or getattr(base.batch_sampler, "batch_size", None)
    if not size and base.batch_sampler is not None:
        size = len(next(iter(base.batch_sampler)))
    if not size:
        raise TypeError(f"the train loader ({type(base).__name__}) has no batch size to read; pass a DataLoader "
                        "with batch_size")
    if accelerator is not None and getattr(getattr(accelerator, "dataloader_config", None), "split_batches", False):
        size = max(1, int(size) // int(accelerator.num_processes))
    return int(size)


def describe_loop(accelerator, model, optimizer, loader, updates: int | None = None, max_length: int | None = None,
                  max_grad_norm: float | None = None) -> JobFacts:
    """The job as the loop will run it, from the objects it prepared."""
    base = _base_loader(loader)
    micro = _micro_batch(loader, accelerator)
    how = "declared (begin(max_length=...))"
    if max_length is None:
        max_length, how = longest_collated(base.dataset, base.collate_fn, micro)
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    precision = MIXED_PRECISION.get(mixed)
    scope, source = accelerator_compile(accelerator)
    if (seen := compile_seen(model)) is not None:   # compiled by the program itself, or already by prepare
        scope, source = seen, source or "the prepared model runs torch.compile'd"
    facts = describe_objects(
        accelerator.unwrap_model(model), optimizer, framework="accelerate.Accelerator", micro_batch_size=micro,
        compile=scope, compile_source=source,
        grad_accum_steps=int(accelerator.gradient_accumulation_steps), precision=precision,
        precision_source=f"Accelerator(mixed_precision={mixed!r})" if precision else "", max_length=max_length,
        length_source=how, world_size=int(accelerator.num_processes), updates=updates, max_grad_norm=max_grad_norm)
    if facts.precision is None and mixed == "no":
        facts.precision, facts.precision_source = "fp32", "Accelerator(mixed_precision='no'), fp32 parameters"
    elif facts.precision is None:  # fp8: the estimator traces no fp8 matmuls; the estimate then assumes fp32
        facts.notes.append(f"Accelerator(mixed_precision={mixed!r}) has no train.precision equivalent: not traced")
    return facts


class AccelerateView(HandLoopView):
    """A prepared accelerate loop as the gates' checks read it (:class:`pilotrun.gates.view.TrainingView`): the
    loader's dataset and (a private copy of) its collate, the loop's loss, ``accelerator.backward``'s scaling,
    ``save_pretrained`` (or ``accelerator.save_model``) and ``from_pretrained``."""

    framework = "the loop's loss with accelerator.backward's division by gradient_accumulation_steps"
    targets_key: str | None = "labels"

    def __init__(self, accelerator, model, loader, loss: Callable | None = None, updates: int | None = None,
                 eval_dataset: Any = None, update_ids: UpdateIds | None = None) -> None:
        self.accelerator, self.prepared, self.loader = accelerator, model, loader
        self.loss_fn = loss or _default_loss
        self.updates = updates
        if update_ids is not None:
            self.update_ids = update_ids
        base = _base_loader(loader)
        self.size = _micro_batch(loader, accelerator)
        self.data = C.framework_data(base.dataset, eval_dataset, C.private_collate(base.collate_fn))

    @property
    def model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.prepared)

    def loss(self, model, batch) -> torch.Tensor:
        return self.loss_fn(model, batch)

    def batching(self) -> Batching:
        accum = int(self.accelerator.gradient_accumulation_steps)
        rule = "each micro batch's loss / gradient_accumulation_steps (accelerator.backward)"
        return Batching(self.size, accum, int(self.accelerator.num_processes), len(self.data.train),
                        drop_last=bool(getattr(_base_loader(self.loader), "drop_last", False)),
                        micro_batches_per_epoch=len(self.loader), short_window=rule, normalisation=rule,
                        planned=("updates", self.updates) if self.updates else None,
                        accum_setting="gradient_accumulation_steps")

    def accum_windows(self) -> list[Window]:
        return first_examples_window(self.data, self.size, int(self.accelerator.gradient_accumulation_steps), True)

    def normalisation_cause(self, counts: list[int], sizes: list[int]) -> str | None:
        return ACCELERATE_FIX if len(set(counts)) > 1 else None

    def export(self, folder: Path) -> Exported:
        """``save_pretrained`` of the unwrapped model (a transformers model), else ``accelerator.save_model``."""
        if self.accelerator.num_processes > 1:
            raise NotMeasured("with several processes the export gathers weights with a collective every process "
                              "must join, and the probe runs on rank 0 alone; pilot the export with one process")
        return self.export_with(folder, "accelerate", lambda tmp: self.accelerator.save_model(
            self.prepared, str(tmp), safe_serialization=True), "accelerator.save_model")


def begin(job, accelerator, model, optimizer, train_dataloader, *, updates: int | None = None,
          loss: Callable | None = None, max_length: int | None = None, max_grad_norm: float | None = None,
          eval_dataset: Any = None) -> dict[str, Outcome]:
    """After ``accelerator.prepare``: describe the job (the describe run ends here) or run the probe gates (rank 0
    of the recording run); nothing outside a pilot. ``loss(model, batch)``: the loss as the loop computes it."""
    if not getattr(job, "active", False):
        return {}
    if C.role_name(job) == "describe":
        job.describe(facts=lambda: describe_loop(accelerator, model, optimizer, train_dataloader, updates,
                                                 max_length, max_grad_norm))
        return {}
    if not C.runs_probes(job):
        return {}
    view = AccelerateView(accelerator, model, train_dataloader, loss, updates, eval_dataset,
                          UpdateIds(False, "the loop reports its own ids with job.update(ids=...)"))
    scaler = getattr(accelerator, "scaler", None)
    return probe_and_watch(job, view, train_dataloader, optimizer,
                           lambda: float(scaler.get_scale()) if scaler is not None else None)
