"""How the loss of an update window is normalised over its micro batches — decided once, applied in one place.

The factory contract: when the model accepts ``num_items_in_batch`` it receives the number of
supervised labels in the whole window and the micro-batch losses are summed; otherwise each
micro-batch loss (a mean over its own examples) is weighted by its share of the window's
examples — 1/n for n equal micro batches, less for a short last one — so a short last window is a
mean over its own examples, never scaled as if full.

:func:`window_backward` is the single place where this happens: the loop driver, the
``accum_equivalence`` and ``overfit`` gates and the estimator's trace all call it, so the gate
tests the loop.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from ..devices import query_devices
from .batches import autocast_for, loss_of, seq_len, supervised_count, to_device


class PolicySource(str, Enum):
    """Where the normalisation decision came from (code branches on this, people read ``reason``)."""

    DECLARED = "declared"              # train.loss_normalization: per_micro_batch
    MODEL_OPTS_OUT = "model-opts-out"  # the model sets accepts_loss_kwargs = False
    HF_LOSS = "hf-loss"                # a Hugging Face loss known to honour num_items_in_batch
    SIGNATURE = "signature"            # forward declares num_items_in_batch (or accepts_loss_kwargs = True)
    NO_KWARG = "no-kwarg"              # forward does not take num_items_in_batch
    PROBED_HONOURS = "probed-honours"  # the probe saw the loss halve when num_items_in_batch doubled
    PROBED_IGNORES = "probed-ignores"  # forward takes num_items_in_batch but its loss does not change with it


@dataclass
class LossPolicy:
    pass_num_items: bool
    shift_labels: bool
    reason: str
    source: PolicySource = PolicySource.NO_KWARG


WEIGHTED = "each micro batch's loss weighted by its share of the window's examples"


def unwrap_adapter(model):
    """The model inside a peft ``PeftModel`` (whose forward passes every keyword through to it), else itself: its
    type and signature decide the loss normalisation."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and type(model).__module__.startswith("peft.") else model


def decide_loss_policy(model: torch.nn.Module, declared: str = "auto") -> LossPolicy:
    """Whether to pass ``num_items_in_batch`` (and how to count it), from the model's signature and type."""
    model = unwrap_adapter(model)
    if declared == "per_micro_batch":
        return LossPolicy(False, False, "train.loss_normalization is per_micro_batch (declared): each micro batch's "
                          "own mean, weighted by its share of the window's examples; num_items_in_batch not passed",
                          PolicySource.DECLARED)
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        params = {}
    explicit = "num_items_in_batch" in params
    accepts_attr = getattr(model, "accepts_loss_kwargs", None)
    # A model can only be a transformers model if its modelling code is already imported (asking the lazy
    # `transformers` module for PreTrainedModel would import it: ~2 s for a job that never used it).
    hf = sys.modules.get("transformers.modeling_utils")
    if hf is not None and isinstance(model, hf.PreTrainedModel):
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss, ForMaskedLMLoss

        loss_fn = LOSS_MAPPING.get(str(getattr(model, "loss_type", None)))
        if accepts_attr is False:
            return LossPolicy(False, False, f"the model sets accepts_loss_kwargs = False: {WEIGHTED}",
                              PolicySource.MODEL_OPTS_OUT)
        if loss_fn is ForCausalLMLoss and not getattr(model.config, "is_encoder_decoder", False):
            return LossPolicy(True, True, "Hugging Face causal-LM loss honours num_items_in_batch: supervised "
                              "next-token labels (labels[:, 1:] != -100) in the window, losses summed",
                              PolicySource.HF_LOSS)
        if loss_fn is ForMaskedLMLoss:
            return LossPolicy(True, False, "Hugging Face masked-LM loss honours num_items_in_batch: labels != -100 "
                              "in the window, losses summed", PolicySource.HF_LOSS)
        if explicit:
            return LossPolicy(True, False, "forward declares num_items_in_batch: labels != -100 in the window, "
                              "losses summed", PolicySource.SIGNATURE)
        return LossPolicy(False, False, f"{type(model).__name__} computes a per-batch mean and does not use "
                          f"num_items_in_batch: {WEIGHTED}", PolicySource.NO_KWARG)
    if explicit or accepts_attr is True:
        why = "forward declares num_items_in_batch" if explicit else "the model sets accepts_loss_kwargs = True"
        return LossPolicy(True, False, f"{why}: labels != -100 in the window, losses summed", PolicySource.SIGNATURE)
    return LossPolicy(False, False, f"forward does not declare num_items_in_batch: {WEIGHTED}", PolicySource.NO_KWARG)


def is_hf_causal_lm(model) -> bool:
    model = unwrap_adapter(model)
    hf = sys.modules.get("transformers.modeling_utils")  # (as in loss_policy: never imported to ask)
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


@contextlib.contextmanager
def rng_untouched():
    """Every generator as it was before: a probe must leave no trace in the random streams."""
    py, cpu = random.getstate(), torch.get_rng_state()
    np_state = None
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    accelerator = query_devices().runtime
    streams = accelerator.rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        torch.set_rng_state(cpu)
        if np_state is not None:
            import numpy as np

            np.random.set_state(np_state)
        accelerator.set_rng_state(streams)


def probe_loss_policy(model, batch: dict, device: torch.device, precision: str, static: LossPolicy) -> LossPolicy:
    """Ask the model itself: does its loss follow ``num_items_in_batch``? Two no-grad forwards in eval mode,
    with N and 2N; a loss that halves honours it. Random states are restored, so the probe leaves no trace."""
    if static.source is PolicySource.DECLARED:
        return static
    shift = is_hf_causal_lm(model)
    if not isinstance(batch, dict) or not isinstance(batch.get("labels"), torch.Tensor):
        return static
    n = max(supervised_count(batch, shift), 1)
    was_training = model.training
    model.eval()
    try:
        with rng_untouched(), torch.no_grad(), autocast_for(device, precision):
            b = to_device(batch, device)
            one = loss_of(model(**b, num_items_in_batch=torch.tensor(n, device=device)))
            two = loss_of(model(**b, num_items_in_batch=torch.tensor(2 * n, device=device)))
    except TypeError as exc:
        if "num_items_in_batch" in str(exc):  # Python's own "unexpected keyword argument" message
            return LossPolicy(False, False, f"forward does not take num_items_in_batch: {WEIGHTED}",
                              PolicySource.NO_KWARG)
        return static  # another contract problem: first_step reports it with the update and the ids
    except Exception:
        return static
    finally:
        model.train(was_training)
    a, b2 = float(one), float(two)
    count = "next-token labels (labels[:, 1:] != -100)" if shift else "labels != -100"
    if math.isfinite(a) and math.isfinite(b2) and a != 0 and math.isclose(a, 2 * b2, rel_tol=1e-2):
        return LossPolicy(True, shift, f"probed: the loss halves when num_items_in_batch doubles, so pilotrun passes "
                                       f"the window's {count} and sums the micro-batch losses",
                          PolicySource.PROBED_HONOURS)
    return LossPolicy(False, False, "probed: forward takes num_items_in_batch but its loss does not change with it, "
                                    f"so {WEIGHTED}", PolicySource.PROBED_IGNORES)


MicroBatchContext = Callable[[torch.nn.Module, int, int], contextlib.AbstractContextManager]
# (loss, fp16 grad scaler or None): one micro batch's backward. The loop passes its strategy's
# (pilotrun.strategies.Strategy.backward, one layer up); everyone else runs the plain one.
Backward = Callable[[torch.Tensor, torch.amp.GradScaler | None], None]


def _no_context(model, index, count):
    return contextlib.nullcontext()


def plain_backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None = None) -> None:
    """Backward of ``loss``, scaled by the fp16 grad scaler when there is one (every strategy's default)."""
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()


def window_backward(model, window: list, policy: LossPolicy, device: torch.device, precision: str,
                    scaler=None, num_items: int | None = None, stats: bool = True,
                    window_examples: int | None = None, grad_scale: float = 1.0,
                    micro_batch: MicroBatchContext = _no_context, backward: Backward = plain_backward) -> dict:
    """Forward and backward over one update window ``[(ids, batch), ...]``, normalised as described above.

    With several ranks, ``num_items`` and ``window_examples`` count the whole window over all of them and
    ``grad_scale`` undoes the strategy's averaging, so the update equals one process's; ``micro_batch`` is
    the strategy's context around each micro batch (DDP's ``no_sync`` on all but the last) and ``backward``
    its backward of each micro batch's loss (with ``scaler``).
    """
    ids_all = [i for ids, _ in window for i in ids]
    if num_items is None:
        num_items = sum(supervised_count(b, policy.shift_labels) for _, b in window)
    window_examples = window_examples or len(ids_all)
    total = torch.zeros((), device=device, dtype=torch.float64)
    aux_total: torch.Tensor | None = None   # a mixture of experts' load-balancing loss, when the model returns one
    tokens = supervised = examples = longest = 0
    for k, (ids, batch) in enumerate(window):
        longest = max(longest, seq_len(batch))
        batch = to_device(batch, device)
        with micro_batch(model, k, len(window)):
            kwargs = {}
            if policy.pass_num_items:
                kwargs["num_items_in_batch"] = torch.tensor(max(num_items, 1), device=device)
            with autocast_for(device, precision):
                out = model(**batch, **kwargs)
            loss = loss_of(out)
            aux = router_aux_loss(out) if stats else None
            # The outputs (a causal LM's logits: 2 x 8192 x 128256 bf16 is 3.9 GiB) are not needed by backward: freed
            # before it, as the Trainer's training_step and torchtitan's loop do, not held through it.
            del out
            if loss.dtype in (torch.float16, torch.bfloat16):
                loss = loss.float()
            if not policy.pass_num_items:
                loss = loss * (len(ids) / window_examples)
            backward_loss = loss * grad_scale if grad_scale != 1.0 else loss
            backward(backward_loss, scaler)
        total += loss.detach()
        if aux is not None:   # the window's mean, each micro batch weighted by its examples
            weighted = aux.double() * (len(ids) / window_examples)
            aux_total = weighted if aux_total is None else aux_total + weighted
        examples += len(ids)
        if not stats:  # fake tensors (the estimator): counting would need their values
            continue
        # Tokens are real tokens (the attention mask), else input_ids positions; images have none.
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim >= 2:
            tokens += int(mask.sum())
        elif isinstance(batch.get("input_ids"), torch.Tensor) and batch["input_ids"].ndim >= 2:
            tokens += batch["input_ids"].numel()
        supervised += supervised_count(batch, policy.shift_labels)
    return {"loss": total, "tokens": tokens, "supervised": supervised, "examples": examples, "seq_len": longest,
            "num_items": num_items, "aux_loss": aux_total}


def router_aux_loss(out) -> torch.Tensor | None:
    """A mixture of experts' load-balancing loss as transformers' MoE models return it (``aux_loss``, with
    ``output_router_logits``; already inside ``loss`` x ``router_aux_loss_coef``), detached; None without one."""
    aux = out.get("aux_loss") if hasattr(out, "get") else getattr(out, "aux_loss", None)
    if isinstance(aux, torch.Tensor) and aux.numel() == 1:
        return aux.detach().reshape(())
    return None
