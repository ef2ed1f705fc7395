"""``accum_equivalence``: an accumulated update window has the gradient of the same examples as one batch.

Computed on a float64 copy of the model on CPU, in eval mode (dropout off, batch
norm on running statistics, so the two computations see the same function), using
the loop's own normalisation (``window_backward``). Checked on the first window and
on the last, short window of an epoch when there is one. Fails for a loss averaged
per micro batch over variable lengths (the model ignores ``num_items_in_batch``)
unless ``train.loss_normalization: per_micro_batch`` declares it on purpose.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import psutil
import torch

from ..drivers import Capability
from ..ledger.records import GateName
from ..train.batches import IGNORE, loss_of, supervised_count, to_device
from ..train.loss import PolicySource, window_backward
from .base import Gate, GateFailure, Outcome, Product

TOL_FLOAT64 = 1e-5  # relative gradient difference; real bugs give 1e-2 and more
TOL_FLOAT32 = 1e-3


def _windows(plan) -> list[tuple[str, list[list[int]]]]:
    """Index lists of the first window and of epoch 0's last window when it is short."""
    order = plan.order(0)
    per_epoch = plan.micro_batches_per_epoch
    first = [plan.micro_batch(0, i, order) for i in range(plan.window_size(0))]
    out = [("first window", first)]
    last_start = (plan.updates_per_epoch - 1) * plan.grad_accum_steps
    last = [plan.micro_batch(0, i, order) for i in range(last_start, per_epoch)]
    full = plan.grad_accum_steps * plan.micro_batch_size
    if last_start > 0 and sum(len(b) for b in last) < full:
        out.append(("last, short window", last))
    return out


def _single_process_plan(plan):
    """The check runs on one rank: the same windows as one process with a replicas-times larger micro batch."""
    import dataclasses

    if plan.replicas == 1:
        return plan
    return dataclasses.replace(plan, micro_batch_size=plan.global_micro_batch, replicas=1, rank=0)


def _grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in model.parameters() if p.requires_grad])


def _float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    return model.to("cpu").to(torch.float64)


def _cast_inputs(batch: dict, dtype: torch.dtype) -> dict:
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in batch.items()}


def _one_batch(model, batch: dict, policy, device) -> float:
    """The reference: the model's own loss on all the window's examples as one batch. Deliberately not
    the loop's code, so a mis-normalising loop cannot agree with itself."""
    batch = to_device(batch, device)
    kwargs = {}
    if policy.pass_num_items:
        labels = batch["labels"][..., 1:] if policy.shift_labels and batch["labels"].ndim >= 2 else batch["labels"]
        kwargs["num_items_in_batch"] = (labels != IGNORE).sum().clamp(min=1)
    loss = loss_of(model(**batch, **kwargs))
    loss.backward()
    return float(loss.detach())


def _same(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _diagnose(model, data, fetched, big, window, policy, device, dtype, tol) -> dict:
    """Why the two computations differ, tested one cause at a time, so the reason names the right one."""
    model.zero_grad(set_to_none=True)
    _one_batch(model, big, policy, device)
    g1 = _grads(model)
    model.zero_grad(set_to_none=True)
    _one_batch(model, big, policy, device)
    g2 = _grads(model)
    model.zero_grad(set_to_none=True)
    if float((g1 - g2).norm()) > tol * (float(g1.norm()) or 1.0):
        return {"kind": "randomness", "cause": "the model is not deterministic in eval mode (the same batch twice "
                "gives different gradients): dropout or another random op that ignores model.eval(), so no "
                "comparison means anything until that is fixed"}
    again = _cast_inputs(data.collate([it for items in fetched for it in items]), dtype)
    if not _same(big, again):
        return {"kind": "randomness", "cause": "the collate is random (the same items collated twice differ): "
                "augmentation or masking drawn inside the collate"}
    counts = [supervised_count(b, policy.shift_labels) for _, b in window]
    sizes = [len(ids) for ids, _ in window]
    if policy.source is PolicySource.PROBED_IGNORES and len(set(counts)) > 1:
        return {"kind": "normalisation", "cause": "the model takes num_items_in_batch but ignores it and averages its "
                "own micro batch, so tokens in micro batches with fewer supervised labels weigh more than in one big "
                "batch: divide the summed token losses by num_items_in_batch, or declare train.loss_normalization: "
                "per_micro_batch on purpose"}
    if not policy.pass_num_items and len(set(counts)) > 1 and len({c / s for c, s in zip(counts, sizes)}) > 1:
        return {"kind": "normalisation", "cause": "the loss is a mean over each micro batch's own labels and the "
                f"micro batches hold different numbers of them ({counts}), so they weigh differently than in one big "
                "batch: accept num_items_in_batch in forward (sum the token losses and divide by it), or declare "
                "train.loss_normalization: per_micro_batch on purpose"}
    return {"kind": "batch-dependence", "cause": "examples influence each other's loss: labels or inputs that depend "
            "on which examples share a batch (e.g. labels taken from a neighbour), outputs that change with padding, "
            "or statistics computed across the batch"}


def _is_dtype_error(exc: RuntimeError) -> bool:
    """torch's words for an op that does not run in the dtype given (its message, the only signal it gives)."""
    text = str(exc)
    return "dtype" in text.lower() or "Double" in text


class AccumEquivalenceGate(Gate):
    name = GateName.ACCUM_EQUIVALENCE
    needs = (Product.DRIVER,)
    requires = (Capability.MODEL,)
    carry = True

    def track(self, ctx):
        return [ctx.model] if ctx.model is not None else []

    def run(self, ctx, meter) -> Outcome:
        spec, driver, data = ctx.spec, ctx.model_driver(), ctx.ensure_data()
        policy = driver.policy
        out = Outcome(inputs={**ctx.base_inputs(), "loss_normalization": spec.train.loss_normalization})
        windows = _windows(_single_process_plan(driver.plan))
        if (spec.train.grad_accum_steps == 1 and len(windows) == 1
                and len(windows[0][1][0]) == spec.train.micro_batch_size):
            out.reason = ("grad_accum_steps is 1 and every micro batch is full: an update is one batch, "
                          "nothing to compare")
            return out
        model, device, dtype, tol = _checking_copy(driver, ctx.device)
        model.eval()
        results: list[WindowResult] = []
        diagnosis: dict = {}
        try:
            for label, micro in windows:
                result, fetched, window, big = _compare_window(model, data, label, micro, policy, device, dtype)
                results.append(result)
                if result.relative_grad_difference > tol and not diagnosis:
                    diagnosis = _diagnose(model, data, fetched, big, window, policy, device, dtype, tol)
        except RuntimeError as exc:
            if dtype == torch.float64 and _is_dtype_error(exc):
                raise GateFailure(f"the model does not run in float64 ({str(exc).splitlines()[0][:150]}); "
                                  "accum_equivalence needs a float64 copy on CPU") from None
            raise
        finally:
            del model
        out.details = {"memory_note": "memory of this row is the check's own model copy, not the job's",
                       "windows": [asdict(r) for r in results], "tolerance": tol,
                       "dtype": str(dtype).replace("torch.", ""), "device": str(device), "mode": "eval (dropout off)",
                       **({"dtype_reason": "the quantised base has no float64 form: float32 copy"}
                          if dtype != torch.float64 and getattr(driver.loaded, "quantized", False) else {}),
                       "loss_normalization": policy.reason}
        return _judge(out, results, diagnosis, tol, device, spec.train.loss_normalization == "per_micro_batch")


@dataclass
class WindowResult:
    """One window's comparison: accumulated over its micro batches vs the same examples as one batch."""

    window: str
    micro_batches: int
    examples: int
    relative_grad_difference: float
    relative_loss_difference: float
    accumulated_loss: float
    one_batch_loss: float
    micro_batch_sizes: list[int]
    supervised_per_micro_batch: list[int]


def _checking_copy(driver, job_device: torch.device):
    """(model, device, dtype, tolerance): a float64 CPU copy when it fits in half the free host memory, else a
    float32 copy on the job's device."""
    n_params = sum(p.numel() for p in driver.plain_model.parameters())
    # A bitsandbytes base holds integer weights dequantised to its compute dtype inside each matmul: it has no
    # float64 form, so its copy is checked in float32 (the details say so).
    quantized = getattr(getattr(driver, "loaded", None), "quantized", False)
    if not quantized and n_params * 8 * 4 < psutil.virtual_memory().available * 0.5:
        try:
            return _float64_copy(driver.plain_model_copy()), torch.device("cpu"), torch.float64, TOL_FLOAT64
        except (RuntimeError, TypeError, ValueError):
            pass
    return driver.plain_model_copy(), job_device, torch.float32, TOL_FLOAT32


def _compare_window(model, data, label: str, micro: list[list[int]], policy, device, dtype):
    """The gradient of one window accumulated by the loop's own code vs the model's own loss on all of it at once."""
    # Each item is fetched once: a dataset that augments from the global RNG gives both computations the
    # same examples.
    fetched = [[data.train[i] for i in idx] for idx in micro]
    window = [([str(it["id"]) for it in items], _cast_inputs(data.collate(items), dtype)) for items in fetched]
    model.zero_grad(set_to_none=True)
    acc = window_backward(model, window, policy, device, "fp32")
    g_acc = _grads(model)
    model.zero_grad(set_to_none=True)
    all_items = [it for items in fetched for it in items]
    big = _cast_inputs(data.collate(all_items), dtype)
    single = _one_batch(model, big, policy, device)
    g_one = _grads(model)
    rel = float((g_acc - g_one).norm()) / (float(g_one.norm()) or 1.0)
    result = WindowResult(
        window=label, micro_batches=len(micro), examples=len(all_items), relative_grad_difference=rel,
        relative_loss_difference=abs(float(acc["loss"]) - single) / (abs(single) or 1.0),
        accumulated_loss=float(acc["loss"]), one_batch_loss=single, micro_batch_sizes=[len(b) for b in micro],
        supervised_per_micro_batch=[supervised_count(b, policy.shift_labels) for _, b in window])
    return result, fetched, window, big


def _judge(out: Outcome, results: list[WindowResult], diagnosis: dict, tol: float, device, declared: bool) -> Outcome:
    worst = max(results, key=lambda r: r.relative_grad_difference)
    summary = "; ".join(f"{r.window} ({'+'.join(map(str, r.micro_batch_sizes))} examples): relative gradient "
                        f"difference {r.relative_grad_difference:.1e}" for r in results)
    if worst.relative_grad_difference <= tol:
        out.reason = f"{summary} (tolerance {tol:.0e}, {out.details['dtype']} on {device})"
        return out
    if declared:
        out.reason = (f"{summary}: differs beyond {tol:.0e}, accepted because train.loss_normalization is "
                      "per_micro_batch (declared)")
        return out
    out.details["diagnosis"] = diagnosis
    cause = diagnosis.get("cause") or "the accumulated and the one-batch computations disagree"
    if (worst.window.startswith("last") and all(r.relative_grad_difference <= tol for r in results[:1])
            and diagnosis.get("kind") != "randomness"):
        cause = ("only the short last window differs: its loss is scaled as if the window were full "
                 "(divided by grad_accum_steps instead of its own size)")
    raise GateFailure(f"accumulated gradient differs from one batch of the same examples: {summary} "
                      f"(tolerance {tol:.0e}); {cause}", inputs=out.inputs, details=out.details)
