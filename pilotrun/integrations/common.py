"""What the Trainer and Lightning callbacks share: the update window, the stage spans and the probe gates.

The probe gates run in the program's own process (the ``probe`` role), on copies of the framework's model
and on batches from its own dataloader and collate, so what they prove is the user's actual setup:

- ``accum_equivalence``: one update of N micro batches of different lengths through the framework's own loss and
  accumulation scaling, vs the same examples as one batch (float64 copy on CPU, eval mode); passes when the
  relative gradient difference is at most ``TOL_FLOAT64`` (the gate's own, :mod:`pilotrun.gates.accum`).
- ``overfit``: a copy trains on ``OVERFIT_EXAMPLES`` examples (AdamW at ``OVERFIT_LR``, its own loss); passes when
  the loss falls below ``OVERFIT_FRACTION`` of its start with every value finite.
- ``reload_eval``: a fresh process loads the export through pilotrun's loading policy (manifest hash recorded,
  safetensors only); passes when its outputs on control inputs are within ``RELOAD_RTOL``/``RELOAD_ATOL``.

Every probe returns a :class:`GateResult`; :func:`run_probe` turns an exception into a ``fail`` row with the
exception's first line, so one broken probe never hides the others.
"""
from __future__ import annotations

import contextlib
import copy
import math
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..gates.accum import TOL_FLOAT64
from ..gates.overfit import frozen_base_shortfall
from ..gates.reload_eval import ATOL as RELOAD_ATOL
from ..gates.reload_eval import RTOL as RELOAD_RTOL
from ..ledger.records import Verdict
from ..models.adapters import parameter_split
from ..train.batches import IGNORE

OVERFIT_UPDATES = 100     # the copy's updates at most; a few examples are learned well within this
OVERFIT_CHECK_EVERY = 10  # the subset's loss is re-measured (eval mode) this often
OVERFIT_FRACTION = 0.1    # learned: the subset's loss fell below this share of its starting loss
STEADY_UPDATES = 3        # the steady_step stage spans this many updates after the first
# The overfit copy's lr: the question is whether the model can learn its own targets at all, not whether the run's lr
# is good (a tiny GPT-2 learns 4 chats in 50 updates at 3e-3 and does not in 100 at 1e-3, measured on CPU).
OVERFIT_LR = 3e-3
OVERFIT_EXAMPLES = 4


@dataclass
class GateResult:
    """One probe's row, as ``job.record_gate(gate, verdict, reason, **measurements)`` takes it."""

    gate: str
    verdict: Verdict
    reason: str
    measurements: dict = field(default_factory=dict)


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


def record(job, result: GateResult) -> GateResult:
    job.record_gate(result.gate, result.verdict, result.reason, **result.measurements)
    return result


def run_probe(job, gate: str, probe: Callable[[], GateResult]) -> GateResult:
    """Run one probe and record its row; an exception is the gate's ``fail`` row (its first line, a traceback in
    the measurements), never a crash of the user's program."""
    try:
        result = probe()
    except Exception as exc:  # user code (model, collate, save) raised inside the probe: that is the finding
        first = (str(exc).splitlines() or [""])[0][:300]
        result = GateResult(gate, Verdict.FAIL, f"{gate} raised {type(exc).__name__}: {first}",
                            {"traceback": traceback.format_exc()[-4000:]})
    return record(job, result)


def skipped(gate: str, reason: str) -> GateResult:
    return GateResult(gate, Verdict.SKIP, reason)


# ---------------------------------------------------------------------------------------------- updates and stages


class UpdateWindow:
    """What one optimizer update saw: the micro batches' losses and sample ids, the lr and grad norm."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.ids: list[Any] = []
        self.ids_missing = False
        self.lr: float | None = None
        self.grad_norm: float | None = None

    def add(self, loss: float | None, ids: Iterable | None) -> None:
        if loss is not None:
            self.losses.append(float(loss))
        if ids is None:
            self.ids_missing = True
        else:
            self.ids.extend(plain(i) for i in ids)

    def report(self, job, update: int, loss: float | None, **extra) -> None:
        job.update(update, loss=loss, lr=self.lr, grad_norm=self.grad_norm,
                   ids=None if self.ids_missing or not self.ids else self.ids, **extra)


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


def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> float | None:
    """The 2-norm of the gradients the optimizer is about to use (None when no parameter has one)."""
    grads = [p.grad.detach().float().norm() for p in parameters if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else None


class StageSpans:
    """``job.stage`` blocks that open in one framework hook and close in another (first_step: from the first
    update's start to its end). Each name is open at most once; whatever is still open at train end closes then."""

    def __init__(self, job) -> None:
        self.job = job
        self.open_spans: dict[str, contextlib.ExitStack] = {}

    def open(self, name: str, inputs: dict | None = None, track: Iterable = ()) -> None:
        if name in self.open_spans:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(self.job.stage(name, inputs=inputs, track=tuple(track)))
        self.open_spans[name] = stack

    def close(self, name: str) -> None:
        stack = self.open_spans.pop(name, None)
        if stack is not None:
            stack.close()

    def is_open(self, name: str) -> bool:
        return name in self.open_spans

    def update_done(self, updates_here: int) -> None:
        """After this process's ``updates_here``-th update: first_step spans the first, steady_step the
        ``STEADY_UPDATES`` after it."""
        if updates_here == 1:
            self.close("first_step")
        elif updates_here == 1 + STEADY_UPDATES:
            self.close("steady_step")

    def close_all(self) -> None:
        for name in list(self.open_spans):
            self.close(name)


# ---------------------------------------------------------------------------------------------------- the probes


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


def first_difference(a: Any, b: Any, name: str = "batch") -> str | None:
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


def random_collate(collate: Callable, items: list) -> GateResult | None:
    """The accum_equivalence skip when ``collate`` gives different batches for the same examples (random masking
    or augmentation): its micro batches and its one batch would then be different inputs, and any gradient
    difference would be the augmentation's, not the loss normalisation's. None when two collations agree."""
    differs = first_difference(collate(items), collate(items))
    if differs is None:
        return None
    return skipped("accum_equivalence", f"not measured: the collate gives different batches for the same examples "
                   f"('{differs}' differs between two collations of the first micro batch): it draws random numbers "
                   "(masking, augmentation), so micro batches and one batch of the same examples are different "
                   "inputs; pilot once with the augmentation off to have the accumulation checked")



def supervised(batch: Any, shift: bool) -> int:
    """Supervised label positions of a collated batch (labels != -100; a causal LM's first position never is)."""
    labels = batch["labels"] if hasattr(batch, "keys") and "labels" in batch.keys() else None
    if not isinstance(labels, torch.Tensor):
        return 0
    if shift and labels.ndim >= 2:
        labels = labels[..., 1:]
    return int((labels != IGNORE).sum())


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU float64 copy in eval mode (dropout off: both computations must see the same function)."""
    return copy.deepcopy(model).to("cpu").to(torch.float64).eval()


def to_float64(batch: Any) -> Any:
    """The batch with floating tensors in float64 on the CPU (integer ids and labels unchanged)."""
    def cast(v):
        if isinstance(v, torch.Tensor):
            v = v.to("cpu")
            return v.to(torch.float64) if v.is_floating_point() else v
        return v
    if hasattr(batch, "items"):
        return {k: cast(v) for k, v in batch.items()}
    return cast(batch)


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in model.parameters() if p.requires_grad])


def accum_equivalence(model: torch.nn.Module, accumulate: Callable[[torch.nn.Module], float],
                      one_batch: Callable[[torch.nn.Module], float], micro_sizes: list[int],
                      supervised_counts: list[int], how: str, fix: str) -> GateResult:
    """Compare the gradient of ``accumulate`` (the framework's own accumulation over the micro batches) with
    ``one_batch`` (the same examples as one batch) on ``model`` (a float64 eval copy). ``how`` says which code
    computed each, for the reason; ``fix`` is the framework's own remedy for a loss averaged per micro batch."""
    gate = "accum_equivalence"
    model.zero_grad(set_to_none=True)
    acc_loss = accumulate(model)
    g_acc = flat_grads(model)
    model.zero_grad(set_to_none=True)
    one_loss = one_batch(model)
    g_one = flat_grads(model)
    model.zero_grad(set_to_none=True)
    one_batch(model)
    g_again = flat_grads(model)
    model.zero_grad(set_to_none=True)
    scale = float(g_one.norm()) or 1.0
    rel = float((g_acc - g_one).norm()) / scale
    measurements = {"relative_grad_difference": rel, "tolerance": TOL_FLOAT64, "accumulated_loss": acc_loss,
                    "one_batch_loss": one_loss, "micro_batch_sizes": micro_sizes,
                    "supervised_per_micro_batch": supervised_counts, "dtype": "float64", "mode": "eval (dropout off)",
                    "computed_by": how}
    labelled = any(supervised_counts)
    window = f"{len(micro_sizes)} micro batches ({'+'.join(map(str, micro_sizes))} examples" + (
        f", {'/'.join(map(str, supervised_counts))} supervised labels)" if labelled else ")")
    if float((g_one - g_again).norm()) / scale > TOL_FLOAT64:
        return GateResult(gate, Verdict.FAIL, "the model is not deterministic in eval mode (the same batch twice gives "
                          "different gradients): a random op that ignores model.eval(); no comparison means anything "
                          "until that is fixed", measurements)
    if rel <= TOL_FLOAT64:
        note = "" if len(set(supervised_counts)) > 1 else (
            "; note: the micro batches held equal numbers of labels, so length normalisation was not exercised"
            if labelled else "; the batches have no 'labels' field (fixed-size examples): the accumulation scaling "
            "is what was compared")
        return GateResult(gate, Verdict.PASS, f"{window}: relative gradient difference {rel:.1e} "
                          f"(tolerance {TOL_FLOAT64:.0e}, float64 on CPU){note}", measurements)
    if len(set(supervised_counts)) > 1:
        cause = ("the loss is averaged per micro batch, so tokens of micro batches with fewer supervised labels weigh "
                 f"more than in one big batch (transformers#37766): {fix}")
    else:
        cause = ("examples influence each other's loss (labels or statistics that depend on which examples share a "
                 "batch), or the accumulation is scaled wrongly")
    return GateResult(gate, Verdict.FAIL, f"accumulated gradient differs from one batch of the same examples: "
                      f"{window}, relative difference {rel:.1e} (tolerance {TOL_FLOAT64:.0e}); {cause}", measurements)


def built_from_config(model: torch.nn.Module) -> bool | None:
    """Whether the transformers model in ``model`` (itself, a peft wrapper's base, or a LightningModule's submodule)
    was built from a config, so randomly initialised: ``from_config``/``Model(config)`` leave
    ``config._name_or_path`` empty, ``from_pretrained`` sets it. None without a transformers config (cannot tell)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_name_or_path"):
            return not config._name_or_path
    return None


def overfit(model: torch.nn.Module, train_loss: Callable[[torch.nn.Module], torch.Tensor],
            eval_loss: Callable[[torch.nn.Module], float], examples: int, lr: float) -> GateResult:
    """Train ``model`` (a copy) on a few examples with AdamW at a constant ``lr`` until the loss falls below
    ``OVERFIT_FRACTION`` of its start; ``train_loss`` is the framework's own loss of the subset (backward is ours)."""
    gate = "overfit"
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    start = eval_loss(model)
    if not math.isfinite(start):
        return GateResult(gate, Verdict.FAIL, f"the subset's loss is {start} before training")
    threshold = start * OVERFIT_FRACTION
    checks = [{"update": 0, "loss": start}]
    losses: list[float] = []
    for step in range(1, OVERFIT_UPDATES + 1):
        model.train()
        loss = train_loss(model)
        value = float(loss.detach())
        if not math.isfinite(value):
            return GateResult(gate, Verdict.FAIL, f"loss is {value} at update {step} of the overfit copy",
                              {"losses": losses})
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(value)
        if step % OVERFIT_CHECK_EVERY == 0 or step == OVERFIT_UPDATES:
            now = eval_loss(model)
            checks.append({"update": step, "loss": now})
            if now < threshold:
                break
    bad = next((n for n, p in model.named_parameters() if not torch.isfinite(p.detach()).all()), None)
    last = checks[-1]["loss"]
    measurements = {"examples": examples, "lr": lr, "updates": len(losses), "losses": losses, "checks": checks,
                    "loss_below": threshold, "loss_below_from": f"{OVERFIT_FRACTION:g} of the starting loss"}
    if bad is not None:
        return GateResult(gate, Verdict.FAIL, f"parameter {bad!r} holds inf/NaN after overfitting", measurements)
    if last < threshold:
        return GateResult(gate, Verdict.PASS, f"{examples} examples learned in {len(losses)} updates: loss "
                          f"{start:.3g} -> {last:.3g} (< {threshold:.3g})", measurements)
    frozen_share = 1 - parameter_split(model).trainable_share  # a 4-bit weight counted as the weights it holds
    shortfall = frozen_base_shortfall(start, last, frozen_share, built_from_config(model))
    if shortfall:
        return GateResult(gate, Verdict.WARN, f"{examples} examples not learned in {len(losses)} updates at lr "
                          f"{lr:g}: {shortfall}", measurements)
    return GateResult(gate, Verdict.FAIL, f"{examples} examples not learned in {len(losses)} updates at lr {lr:g}: "
                      f"loss {start:.3g} -> {last:.3g} (needs < {threshold:.3g}). Usual causes: labels that do not "
                      "belong to their inputs, inputs the model cannot see, frozen parameters", measurements)


def compare_reload(expected: torch.Tensor, reloaded: torch.Tensor, what: str, n: int) -> GateResult:
    """The fresh process's outputs against the training process's on the same control inputs."""
    gate = "reload_eval"
    measurements: dict = {"control_examples": n, "tolerance": {"rtol": RELOAD_RTOL, "atol": RELOAD_ATOL},
                          "output_shape": list(expected.shape)}
    if reloaded.shape != expected.shape:
        return GateResult(gate, Verdict.FAIL, f"the reloaded {what} returns outputs of shape {tuple(reloaded.shape)}, "
                          f"the trained model {tuple(expected.shape)}", measurements)
    diff = float((reloaded - expected).abs().max()) if expected.numel() else 0.0
    measurements["max_abs_difference"] = diff
    if not torch.allclose(reloaded, expected, rtol=RELOAD_RTOL, atol=RELOAD_ATOL):
        return GateResult(gate, Verdict.FAIL, f"the reloaded {what} does not reproduce the model's outputs on {n} "
                          f"control inputs: max difference {diff:.3g} (rtol {RELOAD_RTOL:g}, atol {RELOAD_ATOL:g}) "
                          "— weights missing from the export, or state the artifact does not carry", measurements)
    return GateResult(gate, Verdict.PASS, f"the {what}, reloaded in a fresh process, reproduces the outputs on {n} "
                      f"control inputs (max difference {diff:.2g})", measurements)
