"""``accum_equivalence``: an accumulated update window has the gradient of the same examples as one batch.

Written once for every view (:mod:`pilotrun.gates.view`): computed on a float64 copy of the model on CPU (float32
on the job's device when float64 does not fit or does not exist), in eval mode (dropout off, batch norm on running
statistics, so the two computations see the same function). The accumulated side is the job's own code (pilotrun's
loop: ``window_backward``; a Trainer: its ``compute_loss`` with its accumulation scaling; Lightning: its
``training_step`` divided by ``accumulate_grad_batches``); the reference is the model's own loss of all the window's
examples as one batch. pilotrun's loop checks its first window and the last, short window of an epoch; a framework's
view checks micro batches of the first examples, regrouped by length so that length normalisation is exercised.
Fails for a loss averaged per micro batch over variable lengths, naming the framework's fix, unless
``train.loss_normalization: per_micro_batch`` declares it on purpose; skips when the collate itself is random. An
accumulated gradient that is exactly k times the one batch's is named as the loss normalisation (a loss that ignores
the count it is given), never as examples influencing each other. A program that does not accumulate is compared as
if it did: a difference there is a ``warn`` (a latent defect, with its cause and fix), not this run's failure.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import psutil
import torch

from ..drivers import Capability
from ..ledger.records import GateName, TextEnum
from ..train.batches import cast_floats, supervised_count
from .base import NEEDS_INTEGRATION, Gate, GateFailure, OnProgram, Outcome, ProbeSite, Product
from .view import NotMeasured, TrainingView, Window, WindowKind

TOL_FLOAT64 = 1e-5  # relative gradient difference; real bugs give 1e-2 and more
TOL_FLOAT32 = 1e-3


@dataclass
class WindowResult:
    """One window's comparison: accumulated over its micro batches vs the same examples as one batch."""

    window: str
    kind: str
    micro_batches: int
    examples: int
    relative_grad_difference: float
    relative_loss_difference: float
    accumulated_loss: float
    one_batch_loss: float
    micro_batch_sizes: list[int]
    supervised_per_micro_batch: list[int]
    # k when the accumulated gradient is k times the one-batch gradient (direction equal within the tolerance,
    # k not 1): a normalisation factor, never examples that influence each other; None otherwise.
    gradient_scale: float | None = None


class Diagnosis(TextEnum):
    """Why an accumulated window's gradient differs from one batch's (``details.diagnosis.kind``)."""

    RANDOMNESS = "randomness"              # the same batch twice differs: nothing compares
    SCALE = "scale"                        # an exact factor: the loss's normalisation over the window
    NORMALISATION = "normalisation"        # a mean per micro batch over different label counts
    BATCH_DEPENDENCE = "batch-dependence"  # none of the above: examples change each other's loss


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in model.parameters() if p.requires_grad])


def first_difference(a, b, name: str = "batch") -> str | None:
    """The first field in which two collated batches differ (tensors by value), or None when they are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b))
        return None if same else name
    if hasattr(a, "keys") and hasattr(b, "keys"):
        if set(a.keys()) != set(b.keys()):
            return name
        return next((d for k in a.keys() if (d := first_difference(a[k], b[k], str(k))) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True))
                     if (d := first_difference(x, y, f"{name}[{i}]")) is not None), None)
    return None if a == b else name


def first_examples_window(data, micro_batch_size: int, grad_accum_steps: int, shift: bool) -> list[Window]:
    """For a framework's view: ``max(accumulation, 2)`` micro batches of the dataset's first examples; regrouped by
    their own label counts when the micro batches would hold equal numbers (length normalisation unexercised)."""
    n, size = max(grad_accum_steps, 2), micro_batch_size
    items = [data.train[i] for i in range(min(n * size, len(data.train)))]
    if len(items) < n * size:
        raise NotMeasured(f"the training set has {len(items)} examples; {n} micro batches of {size} need {n * size}")

    def chunks(its: list) -> list[list]:
        return [its[i * size:(i + 1) * size] for i in range(n)]

    micro = chunks(items)
    if len({supervised_count(data.collate(m), shift) for m in micro}) == 1:
        micro = chunks(sorted(items, key=lambda it: supervised_count(data.collate([it]), shift)))
    return [Window(WindowKind.SAMPLE, f"{n} micro batches of the first {n * size} examples", micro)]


def random_collate_reason(view: TrainingView, items: list) -> str | None:
    """Why the check cannot mean anything when the collate gives different batches for the same examples (random
    masking or augmentation: micro batches and one batch would be different inputs); None when two collations
    agree."""
    differs = first_difference(view.data.collate(items), view.data.collate(items))
    if differs is None:
        return None
    return (f"not measured: the collate gives different batches for the same examples ('{differs}' differs between "
            "two collations of the first micro batch): it draws random numbers (masking, augmentation), so micro "
            "batches and one batch of the same examples are different inputs; pilot once with the augmentation off "
            "to have the accumulation checked")


# A mixture of experts' load-balancing loss (transformers' output_router_logits) is a statistic of each micro batch's
# routing, added to that micro batch's loss: no accumulation equals one batch for it. The check compares the rest.
ROUTER_AUX_WARNING = (
    "the router's load-balancing loss (output_router_logits) was left out of the comparison: the model adds "
    "router_aux_loss_coef x it to every micro batch's loss, computed on that micro batch's routing, so it never equals "
    "one batch's, and where the micro batches' losses are summed (num_items_in_batch) it weighs grad_accum_steps x "
    "router_aux_loss_coef per update")


def _without_router_aux_loss(model: torch.nn.Module) -> bool:
    """Turn the copy's router aux loss off (its own config: a deep copy or a rebuild); True when it was on."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return False
    config.output_router_logits = False
    return True


def _experts_in_float64(model: torch.nn.Module) -> None:
    """transformers' mixtures of experts run their experts as torch._grouped_mm, which has no float64 kernel: the
    float64 copy (a deep copy, its own config) runs the same experts as their per-expert loop, transformers' "eager"
    implementation (the same matmuls, one expert at a time)."""
    implementation = getattr(getattr(model, "config", None), "_experts_implementation", None)
    setter = getattr(model, "set_experts_implementation", None)
    if implementation not in (None, "eager") and callable(setter):
        setter("eager")


def checking_copy(view: TrainingView) -> tuple[torch.nn.Module, torch.device, torch.dtype, float, str | None]:
    """(model, device, dtype, tolerance, why not float64): a float64 CPU copy when it exists and fits in half the
    free host memory, else a float32 copy on the job's device."""
    why = view.float64_problem()
    if why is None and view.parameter_count() * 8 * 4 >= psutil.virtual_memory().available * 0.5:
        why = "a float64 copy does not fit in half the free host memory: float32 copy on the job's device"
    if why is None:
        try:
            model, device = view.model_copy(torch.float64)
            _experts_in_float64(model)
            return model, device, torch.float64, TOL_FLOAT64, None
        except (RuntimeError, TypeError, ValueError):
            why = "the model could not be copied to float64: float32 copy on the job's device"
    model, device = view.model_copy(None)
    return model, device, torch.float32, TOL_FLOAT32, why


def compare_window(view: TrainingView, model, window: Window, device, dtype) -> tuple[WindowResult, object]:
    """The gradient of one window accumulated by the job's own code vs the model's own loss on all of it at once;
    the result, and the one batch (for the diagnosis)."""
    data = view.data
    micro = [(items, cast_floats(data.collate(items), dtype)) for items in window.micro]
    model.zero_grad(set_to_none=True)
    acc = view.accumulate(model, micro, device)
    g_acc = grads(model)
    model.zero_grad(set_to_none=True)
    big = cast_floats(data.collate([it for items in window.micro for it in items]), dtype)
    single = view.one_batch(model, big, device)
    g_one = grads(model)
    model.zero_grad(set_to_none=True)
    rel = float((g_acc - g_one).norm()) / (float(g_one.norm()) or 1.0)
    scale = exact_scale(g_acc, g_one, TOL_FLOAT64 if dtype == torch.float64 else TOL_FLOAT32)
    result = WindowResult(
        window=window.label, kind=str(window.kind), micro_batches=len(micro),
        examples=sum(len(items) for items in window.micro), relative_grad_difference=rel,
        relative_loss_difference=abs(acc - single) / (abs(single) or 1.0), accumulated_loss=acc,
        one_batch_loss=single, micro_batch_sizes=[len(items) for items in window.micro],
        supervised_per_micro_batch=[supervised_count(b, view.shift_labels) for _, b in micro], gradient_scale=scale)
    return result, big


def exact_scale(g_acc: torch.Tensor, g_one: torch.Tensor, tol: float) -> float | None:
    """k when ``g_acc`` is ``k * g_one`` within ``tol`` (relative) and k differs from 1 by more than ``tol``; else
    None. The least-squares k, so a gradient off by a factor is told from one pointing elsewhere."""
    norm = float(g_one.norm())
    if norm == 0.0:
        return None
    k = float(g_acc @ g_one) / norm ** 2
    if abs(k - 1.0) <= tol or k == 0.0:
        return None
    return k if float((g_acc - k * g_one).norm()) <= tol * abs(k) * norm else None


def scale_cause(view: TrainingView, scale: float, micro_batches: int) -> str:
    """Why the window's gradient is ``scale`` times the one batch's, in the framework's terms where its view says
    them (``scale_cause(scale, micro_batches)``, optional), else in general ones."""
    own = getattr(view, "scale_cause", None)
    said = own(scale, micro_batches) if callable(own) else None
    if isinstance(said, str) and said:
        return said
    ratio = f"exactly {scale:.4g}x the one-batch gradient"
    if abs(scale - micro_batches) <= 1e-3 * micro_batches:
        how = (f"the loss normalisation: each micro batch's loss is a mean over its own examples and the window adds "
               f"the {micro_batches} means without dividing by their count: divide each micro batch's loss by the "
               "window's micro-batch count (or sum the window's losses and divide by its examples)")
    elif abs(scale * micro_batches - 1.0) <= 1e-3:
        how = (f"the loss normalisation: the window's loss is divided by the {micro_batches} micro batches twice "
               "(once by the loss, once by the loop): divide once")
    else:
        how = ("the loss normalisation: the window's loss is divided by another count than its examples (a fixed "
               "denominator, a wrong micro-batch count): divide by the window's own examples or supervised labels")
    return f"the accumulated gradient is {ratio}: {how}"


def diagnose(view: TrainingView, model, big, result: WindowResult, device, tol: float) -> dict:
    """Why the two computations differ, tested one cause at a time, so the reason names the right one."""
    model.zero_grad(set_to_none=True)
    view.one_batch(model, big, device)
    g1 = grads(model)
    model.zero_grad(set_to_none=True)
    view.one_batch(model, big, device)
    g2 = grads(model)
    model.zero_grad(set_to_none=True)
    if float((g1 - g2).norm()) > tol * (float(g1.norm()) or 1.0):
        return {"kind": Diagnosis.RANDOMNESS, "cause": "the model is not deterministic in eval mode (the same batch "
                "twice gives different gradients): dropout or another random op that ignores model.eval(), so no "
                "comparison means anything until that is fixed"}
    return diagnose_difference(view, result)


def diagnose_difference(view: TrainingView, result: WindowResult) -> dict:
    """The cause of a deterministic difference: an exact factor is the normalisation (issue 44: a Trainer loss that
    ignores its num_items_in_batch gave exactly 2.0x, and was named 'examples influence each other'), then a mean
    per micro batch over different label counts, then batch dependence."""
    if result.gradient_scale is not None:
        return {"kind": Diagnosis.SCALE, "scale": result.gradient_scale,
                "cause": scale_cause(view, result.gradient_scale, result.micro_batches)}
    cause = view.normalisation_cause(result.supervised_per_micro_batch, result.micro_batch_sizes)
    if cause is not None:
        return {"kind": Diagnosis.NORMALISATION, "cause": cause}
    return {"kind": Diagnosis.BATCH_DEPENDENCE, "cause": "examples influence each other's loss: labels or inputs "
            "that depend on which examples share a batch (e.g. labels taken from a neighbour), outputs that change "
            "with padding, or statistics computed across the batch"}


def _is_dtype_error(exc: RuntimeError) -> bool:
    """torch's words for an op that does not run in the dtype given (its message, the only signal it gives)."""
    text = str(exc)
    return "dtype" in text.lower() or "Double" in text


def check_accum(view: TrainingView, out: Outcome | None = None) -> Outcome:
    """The accumulation check on any view; GateFailure when the gradients differ, ``skip`` where it cannot run."""
    out = out or Outcome()
    windows = view.accum_windows()
    b = view.batching()
    if (len(windows) == 1 and len(windows[0].micro) == 1 and len(windows[0].micro[0]) == b.micro_batch_size
            and windows[0].kind != WindowKind.OBSERVED):  # an observed lone micro batch may still be mis-scaled
        out.reason = "grad_accum_steps is 1 and every micro batch is full: an update is one batch, nothing to compare"
        return out
    random = random_collate_reason(view, windows[0].micro[0])
    if random is not None:
        raise NotMeasured(random)
    model, device, dtype, tol, why = checking_copy(view)
    aux_left_out = _without_router_aux_loss(model)
    model.eval()
    results: list[WindowResult] = []
    diagnosis: dict = {}
    try:
        for window in windows:
            result, big = compare_window(view, model, window, device, dtype)
            results.append(result)
            if result.relative_grad_difference > tol and not diagnosis:
                diagnosis = diagnose(view, model, big, result, device, tol)
    except RuntimeError as exc:
        if dtype == torch.float64 and _is_dtype_error(exc):
            raise GateFailure(f"the model does not run in float64 ({str(exc).splitlines()[0][:150]}); "
                              "accum_equivalence needs a float64 copy on CPU", inputs=out.inputs) from None
        raise
    finally:
        del model
    # A framework's view compares 2 micro batches even where the program takes one per update: the comparison is
    # then of what accumulating would do, and the row says so (found on Lightning, accumulate_grad_batches 1).
    as_if = b.grad_accum_steps == 1 and any(len(w.micro) > 1 for w in windows)
    out.details = {"memory_note": "memory of this row is the check's own model copy, not the job's",
                   "program_accumulates": not as_if, "accum_setting": b.accum_setting,
                   "windows": [asdict(r) for r in results], "tolerance": tol,
                   "relative_grad_difference": max(r.relative_grad_difference for r in results),
                   "dtype": str(dtype).replace("torch.", ""), "device": str(device), "mode": "eval (dropout off)",
                   **({"dtype_reason": why} if why else {}), "loss_normalization": b.normalisation,
                   "computed_by": view.framework}
    judged = judge(out, results, diagnosis, tol, device, view.declared_per_micro_batch(),
                   as_if=f"{b.accum_setting} 1" if as_if else None)
    if aux_left_out:
        judged.details["router_aux_loss"] = "left out of the comparison"
        judged.warn(ROUTER_AUX_WARNING)
    return judged


def judge(out: Outcome, results: list[WindowResult], diagnosis: dict, tol: float, device, declared: bool,
          as_if: str | None = None) -> Outcome:
    """``as_if``: the program's own setting when it does not accumulate ("accumulate_grad_batches 1"): the windows
    were accumulated as if it did, and every reason says so."""
    worst = max(results, key=lambda r: r.relative_grad_difference)
    if as_if is None:
        summary = "; ".join(f"{r.window} ({'+'.join(map(str, r.micro_batch_sizes))} examples): relative gradient "
                            f"difference {r.relative_grad_difference:.1e}" for r in results)
    else:
        summary = (f"the program does not accumulate ({as_if}); compared as if it did: "
                   + "; ".join(f"the first {r.examples} examples as one batch vs as {r.micro_batches} micro batches "
                               f"({'+'.join(map(str, r.micro_batch_sizes))}) accumulated: relative gradient difference "
                               f"{r.relative_grad_difference:.1e}" for r in results))
    if worst.relative_grad_difference <= tol:
        out.reason = f"{summary} (tolerance {tol:.0e}, {out.details['dtype']} on {device}){_unexercised(results)}"
        return out
    if declared:
        out.reason = (f"{summary}: differs beyond {tol:.0e}, accepted because train.loss_normalization is "
                      "per_micro_batch (declared)")
        return out
    out.details["diagnosis"] = diagnosis
    cause = diagnosis.get("cause") or "the accumulated and the one-batch computations disagree"
    if as_if is not None:
        # Not this run's failure: its updates are one micro batch each. The defect is real for the day it
        # accumulates, so the row warns, with the cause and its fix.
        out.details["latent"] = True
        out.warn(f"latent accumulation defect, not this run's failure: {summary} (tolerance {tol:.0e}); {cause}")
        return out
    if (WindowKind(worst.kind) == WindowKind.LAST_SHORT and all(r.relative_grad_difference <= tol for r in results[:1])
            and diagnosis.get("kind") != Diagnosis.RANDOMNESS):
        cause = ("only the short last window differs: its loss is scaled as if the window were full "
                 "(divided by grad_accum_steps instead of its own size)")
    raise GateFailure(f"accumulated gradient differs from one batch of the same examples: {summary} "
                      f"(tolerance {tol:.0e}); {cause}", inputs=out.inputs, details=out.details)


def _unexercised(results: list[WindowResult]) -> str:
    """What a pass could not show: length normalisation, when every micro batch held as many labels."""
    counts = {c for r in results for c in r.supervised_per_micro_batch}
    if len(counts) > 1:
        return ""
    if counts == {0}:
        return ("; the batches have no 'labels' field (fixed-size examples): the accumulation scaling is what was "
                "compared")
    return "; note: the micro batches held equal numbers of labels, so length normalisation was not exercised"


def probe(view: TrainingView, site: ProbeSite) -> Outcome:
    """The gate on a framework's view, in the program's process (``Gate.probe``)."""
    return check_accum(view)


class AccumEquivalenceGate(Gate):
    name = GateName.ACCUM_EQUIVALENCE
    on_program = OnProgram.INTEGRATION
    probe = staticmethod(probe)
    watched = True
    program_note = NEEDS_INTEGRATION
    needs = (Product.DRIVER,)
    requires = (Capability.MODEL,)
    carry = True

    def track(self, ctx):
        return [ctx.model] if ctx.model is not None else []

    def run(self, ctx, meter) -> Outcome:
        out = Outcome(inputs={**ctx.base_inputs(), "loss_normalization": ctx.spec.train.loss_normalization})
        return check_accum(ctx.view(), out)
