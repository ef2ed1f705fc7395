"""The training loop the gates drive: one call to :meth:`Trainer.update` is one optimizer update.

Accumulation follows the SPEC contract: the whole update window is fetched first;
when the model accepts ``num_items_in_batch`` it receives the number of supervised
labels in the window and the micro-batch losses are summed; otherwise each
micro-batch loss (a mean over its own examples) is weighted by its share of the
window's examples — 1/n for n equal micro batches, less for a short last one — so
a short last window is a mean over its own examples, never scaled as if full. fp16 uses a grad scaler
stepped once per update, on the real boundary.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import random
import sys
import time
from dataclasses import dataclass, field

import torch

from ..config.spec import Spec
from .optim import build_optimizer, build_scheduler
from .sampler import DataPlan, PositionedBatchSampler

IGNORE = -100


class TrainingCheckError(RuntimeError):
    """A check inside the loop refused an update before it was applied; the message is the reason."""


class UpdateRejected(TrainingCheckError):
    """The window teaches nothing (no supervised label, no gradient); the optimizer did not step."""


class NonFiniteError(TrainingCheckError):
    """A loss, gradient norm or parameter is inf/NaN; the message names the update and the example ids."""

    def __init__(self, what: str, step: int, value: float, ids: list[str], hint: str = "") -> None:
        self.what, self.step, self.value, self.ids = what, step, value, ids
        shown = ", ".join(ids[:8]) + (f" (+{len(ids) - 8} more)" if len(ids) > 8 else "")
        super().__init__(f"{what} is {value} at update {step}{hint}; examples in that update: {shown}")


class ContractError(TypeError):
    """User code does not follow the SPEC factory contract; the message says which part."""


@dataclass
class LossPolicy:
    pass_num_items: bool
    shift_labels: bool
    reason: str


def decide_loss_policy(model: torch.nn.Module, declared: str = "auto") -> LossPolicy:
    """Whether to pass ``num_items_in_batch`` (and how to count it), with the reason recorded."""
    if declared == "per_micro_batch":
        return LossPolicy(False, False, "train.loss_normalization is per_micro_batch (declared): each micro batch's "
                          "own mean, weighted by its share of the window's examples; num_items_in_batch not passed")
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        params = {}
    explicit = "num_items_in_batch" in params
    accepts_attr = getattr(model, "accepts_loss_kwargs", None)
    # A model can only be a transformers model if transformers is already imported.
    hf = sys.modules.get("transformers")
    if hf is not None and isinstance(model, hf.PreTrainedModel):
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss, ForMaskedLMLoss

        loss_fn = LOSS_MAPPING.get(getattr(model, "loss_type", None))
        if accepts_attr is False:
            return LossPolicy(False, False, "the model sets accepts_loss_kwargs = False: each micro batch's loss weighted by its share of the window's examples")
        if loss_fn is ForCausalLMLoss and not getattr(model.config, "is_encoder_decoder", False):
            return LossPolicy(True, True, "Hugging Face causal-LM loss honours num_items_in_batch: supervised next-token labels (labels[:, 1:] != -100) in the window, losses summed")
        if loss_fn is ForMaskedLMLoss:
            return LossPolicy(True, False, "Hugging Face masked-LM loss honours num_items_in_batch: labels != -100 in the window, losses summed")
        if explicit:
            return LossPolicy(True, False, "forward declares num_items_in_batch: labels != -100 in the window, losses summed")
        return LossPolicy(False, False, f"{type(model).__name__} computes a per-batch mean and does not use num_items_in_batch: each micro batch's loss weighted by its share of the window's examples")
    if explicit or accepts_attr is True:
        why = "forward declares num_items_in_batch" if explicit else "the model sets accepts_loss_kwargs = True"
        return LossPolicy(True, False, f"{why}: labels != -100 in the window, losses summed")
    return LossPolicy(False, False, "forward does not declare num_items_in_batch: each micro batch's loss weighted by its share of the window's examples")


def _is_hf_causal_lm(model) -> bool:
    hf = sys.modules.get("transformers")
    if hf is None or not isinstance(model, hf.PreTrainedModel):
        return False
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    if getattr(model, "loss_type", None) == "ForCausalLM":
        return True
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover
        return False
    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def probe_loss_policy(model, batch: dict, device: torch.device, precision: str, static: LossPolicy) -> LossPolicy:
    """Ask the model itself: does its loss follow ``num_items_in_batch``? Two no-grad forwards in eval mode,
    with N and 2N; a loss that halves honours it. Random states are restored, so the probe leaves no trace."""
    if static.reason.startswith("train.loss_normalization is per_micro_batch"):
        return static
    shift = _is_hf_causal_lm(model)
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if not isinstance(labels, torch.Tensor):
        return static
    counted = labels[..., 1:] if shift and labels.ndim >= 2 else labels
    n = max(int((counted != IGNORE).sum()), 1)
    py, np_state, cpu = random.getstate(), None, torch.get_rng_state()
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast_for(device, precision):
            b = to_device(batch, device)
            one = _loss_of(model(**b, num_items_in_batch=torch.tensor(n, device=device)))
            two = _loss_of(model(**b, num_items_in_batch=torch.tensor(2 * n, device=device)))
    except TypeError as exc:
        if "num_items_in_batch" in str(exc):
            return LossPolicy(False, False, "forward does not take num_items_in_batch: each micro batch's loss weighted "
                                            "by its share of the window's examples")
        return static  # another contract problem: first_step reports it with the update and the ids
    except Exception:
        return static
    finally:
        model.train(was_training)
        random.setstate(py)
        torch.set_rng_state(cpu)
        if np_state is not None:
            import numpy as np

            np.random.set_state(np_state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
    a, b2 = float(one), float(two)
    count = "next-token labels (labels[:, 1:] != -100)" if shift else "labels != -100"
    if math.isfinite(a) and math.isfinite(b2) and a != 0 and math.isclose(a, 2 * b2, rel_tol=1e-2):
        return LossPolicy(True, shift, f"probed: the loss halves when num_items_in_batch doubles, so pilotrun passes "
                                       f"the window's {count} and sums the micro-batch losses")
    return LossPolicy(False, False, "probed: forward takes num_items_in_batch but its loss does not change with it, "
                                    "so each micro batch's loss is weighted by its share of the window's examples")


@dataclass
class UpdateRecord:
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


def count_items(batch: dict, policy: LossPolicy) -> int:
    """Supervised labels in a batch (labels != -100), next-token positions only for HF causal LMs."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if labels is None:
        return 0
    if policy.shift_labels and labels.ndim >= 2:
        labels = labels[..., 1:]
    return int((labels != IGNORE).sum())


def window_backward(model, window: list, policy: LossPolicy, device: torch.device, precision: str,
                    scaler=None, num_items: int | None = None, stats: bool = True,
                    window_examples: int | None = None, grad_scale: float = 1.0) -> dict:
    """Forward and backward over one update window ``[(ids, batch), ...]``, normalised as the loop does.

    This is the single place where accumulation is normalised: the training loop, the
    accum_equivalence gate and the overfit gate all call it, so the gate tests the loop.
    """
    ids_all = [i for ids, _ in window for i in ids]
    if num_items is None:
        num_items = sum(count_items(b, policy) for _, b in window)
    # With several ranks, the window's examples and labels are counted over all of them and
    # ``grad_scale`` undoes the strategy's averaging, so the update equals one process's.
    window_examples = window_examples or len(ids_all)
    total = torch.zeros((), device=device, dtype=torch.float64)
    tokens = supervised = examples = seq_len = 0
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    for k, (ids, batch) in enumerate(window):
        seq_len = max(seq_len, _seq_dim(batch))
        batch = to_device(batch, device)
        # DDP all-reduces once per update: on the last micro batch, not on every one.
        # (no_sync must cover the forward as well as the backward.)
        with model.no_sync() if ddp and k < len(window) - 1 else contextlib.nullcontext():
            kwargs = {}
            if policy.pass_num_items:
                kwargs["num_items_in_batch"] = torch.tensor(max(num_items, 1), device=device)
            with autocast_for(device, precision):
                out = model(**batch, **kwargs)
            loss = _loss_of(out)
            if loss.dtype in (torch.float16, torch.bfloat16):
                loss = loss.float()
            if not policy.pass_num_items:
                # Each micro batch's mean weighted by its share of the window's examples: equal
                # micro batches get 1/n_micro, a short last micro batch gets less.
                loss = loss * (len(ids) / window_examples)
            backward_loss = loss * grad_scale if grad_scale != 1.0 else loss
            if scaler is not None:
                scaler.scale(backward_loss).backward()
            else:
                backward_loss.backward()
        total += loss.detach()
        examples += len(ids)
        if not stats:  # fake tensors (the estimator): counting would need their values
            continue
        # Tokens are real tokens (the attention mask), else input_ids positions; images have none.
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim >= 2:
            tokens += int(mask.sum())
        elif isinstance(batch.get("input_ids"), torch.Tensor) and batch["input_ids"].ndim >= 2:
            tokens += batch["input_ids"].numel()
        supervised += count_items(batch, policy)
    return {"loss": total, "tokens": tokens, "supervised": supervised, "examples": examples, "seq_len": seq_len,
            "num_items": num_items}


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


def _loss_of(out) -> torch.Tensor:
    if isinstance(out, dict) or hasattr(out, "keys"):
        loss = out.get("loss") if hasattr(out, "get") else None
    else:
        loss = getattr(out, "loss", None)
    if loss is None:
        raise TypeError(
            f"forward returned {type(out).__name__} without a loss; the contract wants an object with .loss "
            "or a mapping with 'loss' when the batch has 'labels'"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"the loss must be a scalar tensor, got {type(loss).__name__} of shape {getattr(loss, 'shape', '?')}")
    return loss.reshape(())


def token_accuracy(logits: torch.Tensor, labels: torch.Tensor, shift: bool | None) -> tuple[int, int, bool]:
    """(correct, counted, shifted) over supervised positions. ``shift=None`` when the model's convention
    is unknown (a user's own LM): both alignments are scored and the better one is kept."""
    def score(s: bool) -> tuple[int, int]:
        pred = (logits[:, :-1] if s else logits).argmax(-1)
        tgt = labels[:, 1:] if s else labels
        mask = tgt != IGNORE
        return int(((pred == tgt) & mask).sum()), int(mask.sum())

    if shift is not None:
        return (*score(shift), shift)
    a, b = score(True), score(False)
    return (*a, True) if a[0] >= b[0] else (*b, False)


def _seq_dim(batch) -> int:
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.ndim >= 2 else 0


def to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def autocast_for(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)


class Trainer:
    """Owns optimizer, scheduler, scaler and data position for one model on one device."""

    def __init__(
        self, model: torch.nn.Module, train_set, collate, spec: Spec, device: torch.device, pad_batch=None,
        env=None, reduction_ratio: float = 1.0,
    ) -> None:
        from ..distributed import DistEnv

        self.env = env or DistEnv()
        # 1.0 when the strategy averages gradients over ranks, world_size when it sums them.
        self.grad_scale = self.env.world_size / reduction_ratio if self.env.active else 1.0
        self.model = model
        self.spec = spec
        self.device = device
        t = spec.train
        self.precision = t.precision
        self.optimizer = build_optimizer(model, t.optimizer)
        self.scheduler = build_scheduler(self.optimizer, t.scheduler, t.updates)
        self.scaler = torch.amp.GradScaler(device.type) if t.precision == "fp16" else None
        self.policy = decide_loss_policy(model, t.loss_normalization)
        self.plan = DataPlan(
            n_examples=len(train_set),
            micro_batch_size=t.micro_batch_size,
            grad_accum_steps=t.grad_accum_steps,
            seed=spec.seed,
            shuffle=t.shuffle,
            drop_last=spec.data.drop_last,
            replicas=self.env.world_size,
            rank=self.env.rank,
        )
        self.train_set = train_set
        self.collate = _WithIds(collate)
        self.pad_batch = pad_batch
        self.step = 0
        self.examples_seen = 0
        self.epoch = 0
        self.micro_index = 0
        self._iter = None
        self.last_window: dict = {}
        self.params = [p for p in model.parameters() if p.requires_grad]

    def probe_policy(self) -> LossPolicy:
        """Settle the loss normalisation on the first planned micro batch (see :func:`probe_loss_policy`)."""
        idx = self.plan.micro_batch(self.epoch, self.micro_index)
        items = [self.train_set[i] for i in idx]
        self.policy = probe_loss_policy(self.model, self.collate.collate(items), self.device, self.precision,
                                        self.policy)
        return self.policy

    # -- data -----------------------------------------------------------------
    def _loader_iter(self):
        if self._iter is None:
            sampler = PositionedBatchSampler(self.plan, self.epoch, self.micro_index)
            workers = self.spec.data.num_workers
            # A private generator: creating an iterator must not draw from the global RNG (it would
            # shift every dropout mask after a restore), and worker seeds follow the data position.
            gen = torch.Generator()
            gen.manual_seed((self.plan.seed * 1_000_003 + self.epoch) * 1_000_003 + self.micro_index)
            loader = torch.utils.data.DataLoader(
                self.train_set,
                batch_sampler=sampler,
                collate_fn=self.collate,
                num_workers=workers,
                pin_memory=self.device.type == "cuda",
                persistent_workers=False,
                generator=gen,
            )
            self._iter = iter(loader)
        return self._iter

    def close(self) -> None:
        """Stop DataLoader workers (they hold file handles and processes)."""
        it, self._iter = self._iter, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    # -- one update -----------------------------------------------------------
    def update(self, pad_to: int | None = None, strict: bool = False) -> UpdateRecord:
        """One optimizer update. ``pad_to`` right-pads every micro batch to that length (built-in
        tasks only): the loss is unchanged, the memory is the long run's worst case. ``strict``
        refuses, before the optimizer steps, a window with no supervised label or no gradient."""
        t0 = time.perf_counter()
        n_micro = self.plan.window_size(self.micro_index)
        it = self._loader_iter()
        window = []
        for _ in range(n_micro):
            ids, batch = next(it)
            if not isinstance(batch, dict) or "labels" not in batch:
                keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
                raise ContractError(f"the collate returned no 'labels' (got {keys}); the contract needs a dict of "
                                    "tensors including 'labels'")
            if pad_to is not None and self.pad_batch is not None:
                batch = self.pad_batch(batch, pad_to)
            window.append((ids, batch))
        data_wait = time.perf_counter() - t0
        epoch = self.epoch
        micro_start = self.micro_index
        self.micro_index += n_micro
        if self.micro_index >= self.plan.micro_batches_per_epoch:
            self.epoch, self.micro_index = self.epoch + 1, 0

        step = self.step + 1
        ids_all = [i for ids, _ in window for i in ids]
        self.last_window = {"step": step, "examples": len(ids_all), "ids": ids_all,
                            "seq_len": max((_seq_dim(b) for _, b in window), default=0)}
        lr = float(self.scheduler.get_last_lr()[0])
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)  # no-op unless an earlier update stopped half-way
        num_items = None
        window_examples = None
        if self.env.active:
            from ..distributed import all_sum

            num_items = int(all_sum(self.env, sum(count_items(b, self.policy) for _, b in window), self.device))
            window_examples = self.plan.global_window_examples(micro_start, epoch)
        stats = window_backward(self.model, window, self.policy, self.device, self.precision, self.scaler,
                                num_items=num_items, window_examples=window_examples, grad_scale=self.grad_scale)
        total, tokens, supervised, examples = stats["loss"], stats["tokens"], stats["supervised"], stats["examples"]
        seq_len = stats["seq_len"]
        loss_value = float(total)
        if self.env.active:  # the update's loss and label count over all ranks, as one process would see them
            from ..distributed import all_sum

            loss_value = all_sum(self.env, loss_value, self.device)
            supervised = int(all_sum(self.env, supervised, self.device))
        if not math.isfinite(loss_value):
            hint = " (the window has no supervised labels: every label is -100, so its mean is 0/0)" if supervised == 0 else ""
            raise NonFiniteError("loss", step, loss_value, ids_all, hint)

        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.spec.train.max_grad_norm
        grads = [p for p in self.params if p.grad is not None]
        if grads:
            norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm is not None else float("inf"))
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        else:
            grad_norm = None
        if strict:
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
        skipped = False
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale_before
        else:
            if grad_norm is not None and not math.isfinite(grad_norm):
                raise NonFiniteError("gradient norm", step, grad_norm, ids_all)
            self.optimizer.step()
        self.scheduler.step()
        # Free gradients right after the step, as HF Trainer and most loops do: they are
        # not live during the next forward or during evaluation.
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        self.examples_seen += examples
        seconds = time.perf_counter() - t0
        return UpdateRecord(
            step=step,
            loss=loss_value,
            lr=lr,
            grad_norm=grad_norm,
            sample_ids=ids_all,
            examples=examples,
            tokens=tokens,
            supervised=supervised,
            micro_batches=n_micro,
            seconds=seconds,
            data_wait_s=data_wait,
            epoch=epoch,
            seq_len=seq_len,
            scaler_skipped=skipped,
        )

    def check_parameters_finite(self) -> str | None:
        """The name of the first parameter holding inf/NaN, or None."""
        for name, p in self.model.named_parameters():
            if not torch.isfinite(p.detach()).all():
                return name
        return None

    # -- state ----------------------------------------------------------------
    def position(self) -> dict:
        return {
            "epoch": self.epoch,
            "micro_index": self.micro_index,
            "seed": self.plan.seed,
            "shuffle": self.plan.shuffle,
            "micro_batch_size": self.plan.micro_batch_size,
            "grad_accum_steps": self.plan.grad_accum_steps,
            "n_examples": self.plan.n_examples,
        }

    def state(self) -> dict:
        return {"step": self.step, "examples_seen": self.examples_seen, "data_position": self.position()}

    def load_state(self, state: dict) -> None:
        self.close()
        self.step = int(state["step"])
        self.examples_seen = int(state["examples_seen"])
        pos = state["data_position"]
        self.epoch, self.micro_index = int(pos["epoch"]), int(pos["micro_index"])
