"""A Lightning Fabric training loop, piloted: one call after ``fabric.setup`` / ``fabric.setup_dataloaders``.

    import pilotrun
    from pilotrun.integrations.fabric import begin

    job = pilotrun.program()
    fabric = L.Fabric(accelerator="auto", devices=1, precision="32-true")
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    begin(job, fabric, model, optimizer, loader, loss=loss_of, accumulate=2, updates=args.updates)   # pilotrun
    ...  # the loop reports with job.update / job.saved / job.should_stop as any program does

Outside a pilot it does nothing. In the ``describe`` run it describes the job (the model, the optimizer the loop
built, ``accumulate``, the Fabric's precision and world size, the loader's micro batch and the length its collate
gives the longest training examples) and the process ends there. On rank 0 of the run whose rows the pilot records
it runs the probe gates — inspect, batch, accum_equivalence, overfit, export, reload_eval — on copies of the model
under ``fabric.setup``'s wrapper, with the loader's own dataset and collate and the loss as the loop computes it
(``loss(model, batch)``, default ``model(**batch).loss``: Fabric has no loss of its own). Fabric has no accumulation
setting either: ``accumulate`` says how many micro batches the loop runs per optimizer step, each loss divided by it
before ``fabric.backward`` (Fabric's gradient accumulation recipe). The export is ``save_pretrained`` for a
transformers model (reloaded with ``from_pretrained`` in a fresh process), else the module's state dict as
safetensors (no class a fresh process could rebuild it from: reload_eval says so). Every RNG is put back afterwards,
so the run still draws what the interrupted and resumed runs draw.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..gates.accum import first_examples_window
from ..gates.base import Outcome
from ..gates.view import Batching, Exported, NotMeasured, UpdateIds, Window
from ..program.describe import LIGHTNING_PRECISION, JobFacts, compile_seen, describe_objects, longest_collated
from ..train.batches import to_device
from . import common as C
from .loops import HandLoopView
from .observe import probe_and_watch

try:
    from lightning.fabric.wrappers import is_wrapped
except ImportError:
    try:  # the standalone package of the same code
        from lightning_fabric.wrappers import is_wrapped  # type: ignore[no-redef,unused-ignore]
    except ImportError as exc:  # the optional extra is not installed
        raise ImportError("pilotrun.integrations.fabric needs Lightning 2.x (lightning.fabric), which is not "
                          "installed: pip install 'pilotrun[lightning]' (or pip install lightning)") from exc

WEIGHTS = "model.safetensors"  # the export of a module that is not a transformers model

FABRIC_FIX = ("the loop divides each micro batch's mean loss by the accumulation count before fabric.backward, so "
              "tokens of micro batches with fewer supervised labels weigh more than in one big batch: count the "
              "window's supervised tokens before its micro batches and divide each one's summed token losses by "
              "them (times the accumulation count), or average over examples instead of tokens")


def _default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    out = model(**batch)
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None:
        raise TypeError(f"{type(model).__name__}(**batch) returned no loss: pass loss=lambda model, batch: ... to "
                        "begin() (the loss as the loop computes it; Fabric has none of its own)")
    return loss


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under ``fabric.setup``'s ``_FabricModule`` (a plain module as it is)."""
    return model.module if is_wrapped(model) and isinstance(model.module, torch.nn.Module) else model


def _micro_batch(loader: Any) -> int:
    """Examples per forward on one process: Fabric's loader keeps the batch size it was given on every process."""
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    if not size and loader.batch_sampler is not None:
        size = len(next(iter(loader.batch_sampler)))
    if not size:
        raise TypeError(f"the train loader ({type(loader).__name__}) has no batch size to read; pass a DataLoader "
                        "with batch_size")
    return int(size)


def _precision(fabric) -> str:
    """Fabric's precision setting as its plugin names it ("32-true", "bf16-mixed", ...)."""
    return str(getattr(getattr(fabric.strategy, "precision", None), "precision", "32-true"))


def describe_loop(fabric, model, optimizer, loader, accumulate: int = 1, updates: int | None = None,
                  max_length: int | None = None, max_grad_norm: float | None = None) -> JobFacts:
    """The job as the loop will run it, from the objects Fabric set up."""
    micro = _micro_batch(loader)
    how = "declared (begin(max_length=...))"
    if max_length is None:
        max_length, how = longest_collated(loader.dataset, loader.collate_fn, micro)
    setting = _precision(fabric)
    precision = LIGHTNING_PRECISION.get(setting)
    seen = compile_seen(model)   # fabric.setup(torch.compile(model)): its _FabricModule runs the compiled module
    facts = describe_objects(
        unwrap(model), optimizer, framework="lightning.Fabric", micro_batch_size=micro, grad_accum_steps=accumulate,
        compile=seen, compile_source="the set-up model runs torch.compile'd" if seen else "",
        precision=precision, precision_source=f"Fabric(precision={setting!r})" if precision else "",
        max_length=max_length, length_source=how, world_size=int(fabric.world_size), updates=updates,
        max_grad_norm=max_grad_norm)
    if facts.precision is None:  # "16-true", "transformer-engine": no train.precision equivalent to trace
        facts.notes.append(f"Fabric(precision={setting!r}) has no train.precision equivalent: not traced")
    return facts


class FabricView(HandLoopView):
    """A Fabric loop as the gates' checks read it (:class:`pilotrun.gates.view.TrainingView`): the loader's dataset
    and (a private copy of) its collate, the loop's loss with each micro batch's divided by ``accumulate``,
    ``save_pretrained`` (or the state dict as safetensors) and ``from_pretrained``."""

    framework = "the loop's loss, each micro batch's divided by the accumulation count before fabric.backward"
    targets_key: str | None = "labels"

    def __init__(self, fabric, model, loader, loss: Callable | None = None, accumulate: int = 1,
                 updates: int | None = None, eval_dataset: Any = None, update_ids: UpdateIds | None = None) -> None:
        self.fabric, self.wrapped, self.loader = fabric, model, loader
        self.loss_fn = loss or _default_loss
        self.accum, self.updates = int(accumulate), updates
        if update_ids is not None:
            self.update_ids = update_ids
        self.size = _micro_batch(loader)
        self.data = C.framework_data(loader.dataset, eval_dataset, C.private_collate(loader.collate_fn))

    @property
    def model(self) -> torch.nn.Module:
        return unwrap(self.wrapped)

    def loss(self, model, batch) -> torch.Tensor:
        # Fabric's loader moves each batch to the device; the probes' batches come from the collate, on the CPU.
        return self.loss_fn(model, to_device(batch, next(model.parameters()).device))

    def batching(self) -> Batching:
        rule = "each micro batch's loss / the accumulation count (the loop's, before fabric.backward)"
        return Batching(self.size, self.accum, int(self.fabric.world_size), len(self.data.train),
                        drop_last=bool(getattr(self.loader, "drop_last", False)),
                        micro_batches_per_epoch=len(self.loader), short_window=rule, normalisation=rule,
                        planned=("updates", self.updates) if self.updates else None,
                        accum_setting="begin(accumulate=...)")

    def accum_windows(self) -> list[Window]:
        return first_examples_window(self.data, self.size, self.accum, True)

    def normalisation_cause(self, counts: list[int], sizes: list[int]) -> str | None:
        return FABRIC_FIX if len(set(counts)) > 1 else None

    def export(self, folder: Path) -> Exported:
        """``save_pretrained`` of the module (a transformers model), else its state dict as safetensors."""
        if self.fabric.world_size > 1:
            raise NotMeasured("with several processes a sharded module's state dict is gathered with a collective "
                              "every process must join, and the probe runs on rank 0 alone; pilot the export with "
                              "one process")
        def state_dict_file(tmp: Path) -> None:
            from safetensors.torch import save_model

            save_model(self.model, str(tmp / WEIGHTS))

        return self.export_with(folder, "lightning.Fabric loop", state_dict_file,
                                "safetensors of the module's state_dict")


def begin(job, fabric, model, optimizer, train_dataloader, *, loss: Callable | None = None, accumulate: int = 1,
          updates: int | None = None, max_length: int | None = None, max_grad_norm: float | None = None,
          eval_dataset: Any = None) -> dict[str, Outcome]:
    """After ``fabric.setup`` and ``fabric.setup_dataloaders``: describe the job (the describe run ends here) or run
    the probe gates (rank 0 of the recording run); nothing outside a pilot. ``loss(model, batch)``: the loss as the
    loop computes it; ``accumulate``: the micro batches per optimizer step (each loss divided by it)."""
    if not getattr(job, "active", False):
        return {}
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"begin(accumulate=...) is the micro batches per optimizer step, a whole number >= 1; got "
                         f"{accumulate!r}")
    if C.role_name(job) == "describe":
        job.describe(facts=lambda: describe_loop(fabric, model, optimizer, train_dataloader, accumulate, updates,
                                                 max_length, max_grad_norm))
        return {}
    if not C.runs_probes(job):
        return {}
    view = FabricView(fabric, model, train_dataloader, loss, accumulate, updates, eval_dataset,
                      UpdateIds(False, "the loop reports its own ids with job.update(ids=...)"))
    scaler = getattr(getattr(fabric, "_precision", None), "scaler", None)
    return probe_and_watch(job, view, train_dataloader, optimizer,
                           lambda: float(scaler.get_scale()) if scaler is not None else None)
