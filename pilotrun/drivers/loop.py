"""pilotrun's own training loop as a driver: one call to :meth:`LoopDriver.update` is one optimizer update.

The whole update window is fetched first; the loss is normalised over it by
:func:`pilotrun.train.loss.window_backward`; fp16 uses a grad scaler stepped once per update, on
the real boundary. The data position is two integers (epoch, micro batch) so a restored driver
continues exactly where the saved one stopped. Built only by :func:`pilotrun.drivers.build.build_driver`.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import backends
from ..checkpoint.export import export_adapter, export_model
from ..checkpoint.saving import PendingSave
from ..checkpoint.state import fingerprint_state
from ..distributed import all_sum
from ..models.adapters import base_reference, merged_copy
from ..models.loading import build_model
from ..models.quantize import kernels_needed, require_kernels
from ..models.structure import repeated_blocks
from ..train.batches import labelled_batch, seq_len, supervised_count
from ..train.compile import CompileRecord, apply_compile, counts_since, dynamo_counts, outside_dispatch_modes
from ..train.evaluation import val_metrics
from ..train.fp8 import Fp8Record, convert_linears
from ..train.loss import LossPolicy, decide_loss_policy, probe_loss_policy, window_backward
from ..train.optim import build_optimizer_choice, build_scheduler
from ..train.rng import derived_seed, seed_everything
from ..train.sampler import DataPlan, PositionedBatchSampler
from .base import (
    Capability,
    ContractError,
    JobInputs,
    JobProcess,
    ModelDriver,
    NonFiniteError,
    UpdateRecord,
    UpdateRejected,
)


class _WithIds:
    """Collate wrapper that keeps the example ids next to the user's batch."""

    def __init__(self, collate) -> None:
        self.collate = collate

    def __call__(self, items):
        ids = []
        for it in items:
            if not isinstance(it, dict) or "id" not in it:
                keys = sorted(it)[:10] if isinstance(it, dict) else type(it).__name__
                raise ContractError(f"a training item has no 'id' (keys: {keys}); every item needs one")
            ids.append(str(it["id"]))
        return ids, self.collate(items)


class LoopDriver(ModelDriver):
    """Owns the model as the strategy runs it, the optimizer, scheduler, scaler and the data position."""

    name = "loop"
    capabilities = frozenset(Capability)

    def __init__(self, model: torch.nn.Module, loaded: Any, data: Any, tokenizer: Any, spec, device: torch.device,
                 env, strategy, reduction_ratio: float = 1.0, how_wrapped: str = "one process") -> None:
        self.model = model            # as the strategy runs it (DDP wrapper, FSDP-sharded module)
        self.loaded = loaded          # pilotrun.models.loading.LoadedModel: the plain model and where it came from
        self.data = data              # pilotrun.data.bundle.DataBundle
        self.tokenizer = tokenizer    # built-in tasks' tokenizer (None for a data factory)
        self.spec = spec
        self.device = device
        self.env = env
        self.strategy = strategy
        self.reduction_ratio = reduction_ratio
        self.how_wrapped = how_wrapped
        # 1.0 when the strategy averages gradients over ranks, world_size when it sums them.
        self.grad_scale = env.world_size / reduction_ratio if env.active else 1.0
        t = spec.train
        self.precision = t.precision
        self.optimizer, self.optimizer_choice = build_optimizer_choice(model, t.optimizer, device)
        self.scheduler = build_scheduler(self.optimizer, t.scheduler, t.updates)
        self.scaler = torch.amp.GradScaler(device.type) if t.precision == "fp16" else None
        self.policy: LossPolicy = decide_loss_policy(model, t.loss_normalization)
        self.plan = DataPlan(
            n_examples=len(data.train), micro_batch_size=t.micro_batch_size, grad_accum_steps=t.grad_accum_steps,
            seed=spec.seed, shuffle=t.shuffle, drop_last=spec.data.drop_last,
            replicas=strategy.data_replicas(env.world_size), rank=strategy.data_rank(env.rank),
        )
        self.train_set = data.train
        self.collate = _WithIds(data.collate)
        self.pad_batch = data.pad_batch
        self.step = 0
        self.examples_seen = 0
        self.epoch = 0
        self.micro_index = 0
        self._iter: Any = None  # the DataLoader's iterator, from the current position
        self.last_window: dict = {}
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.fp8: Fp8Record | None = None  # train.precision fp8: what build converted (train/fp8.py)
        self.compiled: CompileRecord | None = None  # train.compile: what build compiled (train/compile.py)
        self.graphs_per_compile: int | None = None  # graphs the first compiled update made: one shape's compile

    @classmethod
    def build(cls, spec, inputs: JobInputs | None, process: JobProcess, on_model=None, site=None) -> LoopDriver:
        if inputs is None:
            raise ValueError("pilotrun's loop trains on the spec's data: load its inputs first (load_inputs)")
        # every bitsandbytes operation the job runs, before any work
        require_kernels(kernels_needed(spec.model.quantization, spec.train.optimizer), process.device.type)
        seed_everything(spec.seed)
        with process.strategy.init_context(process.device):
            loaded = build_model(spec.model, spec.build_context(), inputs.data.label_names, inputs.tokenizer,
                                 device=process.device)
        if not loaded.quantized:  # a bitsandbytes model was placed on the device as it loaded
            loaded.model = loaded.model.to(process.device)
        # fp8: the Linears swapped for torchao's Float8Linear on the device, before the strategy wraps them (torchao's
        # order for FSDP2); check_job refused a device without float8 matmuls and a missing torchao (exit 2).
        fp8 = convert_linears(loaded.model, spec.train.fp8_recipe) if spec.train.precision == "fp8" else None
        # train.compile: after activation checkpointing (applied while building) and fp8's swap, before the wrap
        # (torchtitan's order: FSDP2 shards the compiled blocks); the compile itself runs in the first update.
        compiled = apply_compile(loaded.model, spec.train.compile, repeated_blocks(loaded.model))
        if on_model is not None:
            on_model(loaded.model)
        ratio = process.strategy.reduction_ratio(process.env, process.device)
        wrapped, how = process.strategy.wrap(loaded.model, process.env, process.device)
        driver = cls(wrapped, loaded, inputs.data, inputs.tokenizer, spec, process.device, process.env,
                     process.strategy, reduction_ratio=ratio, how_wrapped=how)
        driver.fp8 = fp8
        driver.compiled = compiled
        driver.probe_policy()  # the same decision, by the same probe, in every process
        return driver

    @property
    def plain_model(self) -> torch.nn.Module:
        """The model outside any wrapper (the same parameters the strategy runs)."""
        return self.loaded.model

    def probe_policy(self) -> LossPolicy:
        """Settle the loss normalisation on the first planned micro batch (see ``probe_loss_policy``)."""
        idx = self.plan.micro_batch(self.epoch, self.micro_index)
        items = [self.train_set[i] for i in idx]
        # Eager under train.compile: the probe's two no-grad eval forwards would otherwise compile graphs the job
        # never runs, and the compile would land in the load gate instead of the first update's measurement.
        with torch.compiler.set_stance("force_eager") if self.compiled is not None else contextlib.nullcontext():
            self.policy = probe_loss_policy(self.model, self.collate.collate(items), self.device, self.precision,
                                            self.policy)
        return self.policy

    # -- data -----------------------------------------------------------------
    def _loader_iter(self):
        if self._iter is None:
            sampler = PositionedBatchSampler(self.plan, self.epoch, self.micro_index)
            # A private generator: creating an iterator must not draw from the global RNG (it would
            # shift every dropout mask after a restore), and worker seeds follow the data position.
            gen = torch.Generator()
            gen.manual_seed(derived_seed((self.plan.seed * 1_000_003 + self.epoch) * 1_000_003 + self.micro_index))
            loader = torch.utils.data.DataLoader(
                self.train_set, batch_sampler=sampler, collate_fn=self.collate,
                num_workers=self.spec.data.num_workers, pin_memory=backends.for_device(self.device).pin_memory,
                persistent_workers=False, generator=gen,
            )
            self._iter = iter(loader)
        return self._iter

    def close(self) -> None:
        """Stop DataLoader workers (they hold file handles and processes)."""
        it, self._iter = self._iter, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def _fetch_window(self, pad_to: int | None) -> tuple[list, float]:
        """The next update window ``[(ids, batch), ...]`` and the seconds spent waiting for it."""
        t0 = time.perf_counter()
        it = self._loader_iter()
        window = []
        for _ in range(self.plan.window_size(self.micro_index)):
            ids, collated = next(it)
            if (batch := labelled_batch(collated)) is None:
                keys = sorted(collated) if isinstance(collated, Mapping) else type(collated).__name__
                raise ContractError(f"the collate returned no 'labels' (got {keys}); the contract needs a dict of "
                                    "tensors including 'labels'")
            if pad_to is not None and self.pad_batch is not None:
                batch = self.pad_batch(batch, pad_to)
            window.append((ids, batch))
        return window, time.perf_counter() - t0

    def _advance(self, n_micro: int) -> tuple[int, int]:
        """Move the data position past a window; returns where the window started (epoch, micro index)."""
        start = (self.epoch, self.micro_index)
        self.micro_index += n_micro
        if self.micro_index >= self.plan.micro_batches_per_epoch:
            self.epoch, self.micro_index = self.epoch + 1, 0
        return start

    # -- one update -----------------------------------------------------------
    def update(self, pad_to: int | None = None, strict: bool = False) -> UpdateRecord:
        """One optimizer update. ``pad_to`` right-pads every micro batch to that length (built-in tasks only):
        the loss is unchanged, the memory is the long run's worst case. ``strict`` refuses, before the
        optimizer steps, a window with no supervised label or no gradient."""
        t0 = time.perf_counter()
        before = dynamo_counts() if self.compiled is not None else None
        window, data_wait = self._fetch_window(pad_to)
        epoch, micro_start = self._advance(len(window))
        step = self.step + 1
        ids_all = [i for ids, _ in window for i in ids]
        self.last_window = {"step": step, "examples": len(ids_all), "ids": ids_all,
                            "seq_len": max((seq_len(b) for _, b in window), default=0)}
        lr = float(self.scheduler.get_last_lr()[0])
        with outside_dispatch_modes(self.compiled is not None) as paused:
            stats = self._backward(window, epoch, micro_start)
        loss_value, supervised = float(stats["loss"]), stats["supervised"]
        if self.env.active:  # the update's loss and label count over all ranks, as one process would see them
            loss_value = all_sum(self.env, loss_value, self.device)
            supervised = int(all_sum(self.env, supervised, self.device))
        if not math.isfinite(loss_value):
            hint = (" (the window has no supervised labels: every label is -100, so its mean is 0/0)"
                    if supervised == 0 else "")
            raise NonFiniteError("loss", step, loss_value, ids_all, hint)
        extra = {}
        if stats.get("aux_loss") is not None:   # a mixture of experts' load-balancing loss, next to the loss
            aux = float(stats["aux_loss"])
            extra["aux_loss"] = all_sum(self.env, aux, self.device) if self.env.active else aux
        if before is not None:  # what this update compiled: the first update's compile, a new length's recompile
            spent = counts_since(before)
            extra.update(spent.to_dict(), tensor_tracking_paused=paused)
            if self.graphs_per_compile is None and spent.graphs:
                self.graphs_per_compile = spent.graphs
        grad_norm = self._clip()
        if strict:
            self._refuse_if_empty(step, supervised, stats["examples"], grad_norm)
        skipped = self._step(step, grad_norm, ids_all)
        self.step = step
        self.examples_seen += stats["examples"]
        return UpdateRecord(step=step, loss=loss_value, lr=lr, grad_norm=grad_norm, sample_ids=ids_all,
                            examples=stats["examples"], tokens=stats["tokens"], supervised=supervised,
                            micro_batches=len(window), seconds=time.perf_counter() - t0, data_wait_s=data_wait,
                            epoch=epoch, seq_len=stats["seq_len"], scaler_skipped=skipped, extra=extra)

    def _backward(self, window: list, epoch: int, micro_start: int) -> dict:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)  # a no-op unless an earlier update stopped half-way
        num_items = window_examples = None
        if self.env.active:  # the window's labels and examples over every rank
            num_items = int(all_sum(self.env, sum(supervised_count(b, self.policy.shift_labels) for _, b in window),
                                    self.device))
            window_examples = self.plan.global_window_examples(micro_start, epoch)
        return window_backward(self.model, window, self.policy, self.device, self.precision, self.scaler,
                               num_items=num_items, window_examples=window_examples, grad_scale=self.grad_scale,
                               micro_batch=self.strategy.micro_batch, backward=self.strategy.backward)

    def _clip(self) -> float | None:
        """Unscale (fp16), clip to ``train.max_grad_norm`` and return the global gradient norm (None: no gradient),
        as the strategy does it."""
        return self.strategy.clip_gradients(self.params, self.spec.train.max_grad_norm, self.optimizer, self.scaler)

    def _refuse_if_empty(self, step: int, supervised: int, examples: int, grad_norm: float | None) -> None:
        problem = None
        if supervised == 0:
            problem = (f"update {step} has no supervised labels (every label is -100 in {examples} examples): "
                       "nothing is learned; check how the collate masks labels")
        elif grad_norm is None:
            problem = (f"no trainable parameter received a gradient in update {step}: the loss does not depend "
                       "on the parameters (a constant, or computed under no_grad?)")
        elif grad_norm == 0.0:
            problem = (f"update {step} has a gradient norm of exactly 0: the loss does not reach the trainable "
                       "parameters (frozen or detached?)")
        if problem:
            self.optimizer.zero_grad(set_to_none=True)
            raise UpdateRejected(problem)

    def _step(self, step: int, grad_norm: float | None, ids: list[str]) -> bool:
        """Optimizer (the strategy's step) and scheduler step; True when the fp16 scaler skipped the update."""
        # Without a scaler nothing would skip a non-finite update: refuse it here, where the update and its
        # examples are known. With one, the scaler skips it and lowers its scale (reported as skipped).
        if self.scaler is None and grad_norm is not None and not math.isfinite(grad_norm):
            raise NonFiniteError("gradient norm", step, grad_norm, ids)
        skipped = self.strategy.optimizer_step(self.optimizer, self.scaler)
        self.scheduler.step()
        # Free gradients right after the step, as HF Trainer and most loops do: they are not live
        # during the next forward or during evaluation.
        self.optimizer.zero_grad(set_to_none=True)
        return skipped

    def check_parameters_finite(self) -> str | None:
        """The name of the first parameter holding inf/NaN, or None."""
        for name, p in self.model.named_parameters():
            if not torch.isfinite(p.detach()).all():
                return name
        return None

    def optimizer_state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values() for v in st.values()
                   if hasattr(v, "numel"))

    # -- evaluation and copies ----------------------------------------------------
    def evaluate(self, on_batch=None) -> dict:
        # The module itself, not a DDP wrapper (whose forward would sync buffers): what the eval gate always ran.
        with outside_dispatch_modes(self.compiled is not None):
            return val_metrics(self.plain_model, self.data, self.device, batch_size=self.spec.eval_batch_size,
                               max_batches=self.spec.eval.max_batches, precision=self.spec.train.precision,
                               on_batch=on_batch)

    def plain_model_copy(self) -> torch.nn.Module:
        """A copy of the model outside any distributed wrapper, for checks that run on one rank alone.
        One process: a deep copy of the trained model. Several: the model rebuilt from the spec (same seed)."""
        import copy

        if not self.env.active:
            return copy.deepcopy(self.plain_model)
        rebuilt = build_model(self.spec.model, self.spec.build_context(), self.data.label_names, self.tokenizer,
                              device=self.device)
        return rebuilt.model if rebuilt.quantized else rebuilt.model.to(self.device)

    # -- state ----------------------------------------------------------------
    def position(self) -> dict:
        return {
            "epoch": self.epoch, "micro_index": self.micro_index, "seed": self.plan.seed,
            "shuffle": self.plan.shuffle, "micro_batch_size": self.plan.micro_batch_size,
            "grad_accum_steps": self.plan.grad_accum_steps, "n_examples": self.plan.n_examples,
        }

    def state(self) -> dict:
        return {"step": self.step, "examples_seen": self.examples_seen, "data_position": self.position()}

    @property
    def base_identity(self) -> str | None:
        """With an adapter: the frozen base's sha256 as built; checkpoints then hold the adapter alone."""
        return self.loaded.base_identity

    def load_state(self, state: dict) -> None:
        self.close()
        self.step = int(state["step"])
        self.examples_seen = int(state["examples_seen"])
        pos = state["data_position"]
        self.epoch, self.micro_index = int(pos["epoch"]), int(pos["micro_index"])

    def save(self, folder: Path) -> dict:
        return self.strategy.save(folder, self, self.spec.canonical(), self.spec.config_hash(), self.env)

    def start_save(self, folder: Path) -> PendingSave:
        return self.strategy.start_save(folder, self, self.spec.canonical(), self.spec.config_hash(), self.env)

    def restore(self, folder: Path) -> dict:
        return self.strategy.restore(self, folder, self.env)

    def fingerprint(self) -> dict:
        # With several processes every rank calls this (the save gate, the restore worker): it gathers.
        return fingerprint_state(self, self.strategy.buffer_sync(self.model), self.env)

    def export_weights(self) -> dict | None:
        return self.strategy.full_state_dict(self.model)

    def write_export(self, folder: Path, weights: dict | None = None):
        spec = self.spec
        if self.loaded.base_identity is not None:
            merged, note = merged_copy(self.plain_model, self.loaded) if spec.export.merge else (None, None)
            base = base_reference(spec.model, spec.build_context(), self.loaded, self.data.label_names, spec.record())
            return export_adapter(folder, self.plain_model, base, tokenizer=self.tokenizer, merged=merged,
                                  merge_note=note)
        return export_model(folder, self.plain_model, tokenizer=self.tokenizer, factory=spec.model.factory,
                            model_mapping=spec.model.factory_mapping() if spec.model.factory else None,
                            spec_folder=str(spec.folder), state_dict=weights)
