"""The optimizer steps a hand-written loop really takes, watched while it runs (issue 44: a loop that accumulated by
hand with ``step % accum == 0`` took its first step after one micro batch at half its loss, and the batch and
accumulation rows, read from ``gradient_accumulation_steps``, passed it).

:class:`StepObserver` is installed on rank 0 of the recording run after the probe gates: it reads the micro
batches the training loader yields, counts the model's training forwards between two real optimizer steps (a
window starts where the gradients were zero or unset), and, during each backward of the first window, the factor
the loop applied to its loss: the gradient that reaches the loss's reduction (the deepest node of the backward's
linear chain whose output is a scalar), divided by the grad scaler's scale. At the first real step the parameters
are still the window's, so ``accum_equivalence`` is computed there by :class:`ObservedView`: the same window
accumulated on a float64 copy with the loop's own factors injected at the same node of ``loss(model, batch)``'s
graph, against the window's examples as one batch. After a few steps the ``batch`` row is built from the windows
seen. Everything is removed then; nothing of it touches the model's values, the RNG or the steps themselves.
"""
from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..gates.accum import check_accum
from ..gates.base import Outcome, run_check
from ..gates.batch import check_batch
from ..gates.view import Batching, NotMeasured, Window, WindowKind
from ..ledger.records import GateName, Verdict
from ..train.batches import to_device
from ..train.loss import rng_untouched
from . import common as C

OBSERVED_STEPS = 3   # windows counted for the batch row: the first may differ from the steady ones
CHAIN_LIMIT = 64     # nodes followed from a backward's root towards its loss's reduction
PAD = {"labels": -100, "attention_mask": 0, "token_type_ids": 0, "position_ids": 0}


# ------------------------------------------------------------------------------------------ the loss's reduction


def chain_of(root: torch.Tensor) -> list:
    """The backward graph's nodes from ``root`` while each has one input with a gradient (a scalar's arithmetic:
    the loop's division, a grad scaler's multiplication, the loss's own reduction)."""
    nodes: list = []
    node = root.grad_fn
    while node is not None and len(nodes) < CHAIN_LIMIT:
        nodes.append(node)
        after = [f for f, _ in node.next_functions if f is not None]
        if len(after) != 1:
            break
        node = after[0]
    return nodes


def reduction_index(chain: list) -> int | None:
    """The deepest node of a chain whose output is a scalar: where the loss becomes one number (its reduction, or
    the loss's own arithmetic on that number). Read from each node's gradient metadata; None where a node has none
    (an autograd without it) or the chain's root is no scalar."""
    found = None
    for i, node in enumerate(chain):
        meta = getattr(node, "_input_metadata", None)
        if not meta:
            return None
        if len(meta[0].shape) != 0:
            break
        found = i
    return found


class Watch:
    """A pre-hook on one node that records the gradient it receives (``seen``) and, given ``inject``, replaces it
    (the copy's side: the loop's own factor at its loss's reduction)."""

    def __init__(self, node, inject: float | None = None) -> None:
        self.seen: float | None = None
        self.inject = inject
        self.handle = node.register_prehook(self._hook)

    def _hook(self, grad_outputs):
        g = grad_outputs[0]
        if g is None:
            return None
        self.seen = float(g.detach().double().sum())
        if self.inject is None:
            return None
        return (torch.full_like(g, self.inject),) + tuple(grad_outputs[1:])

    def remove(self) -> None:
        self.handle.remove()


@dataclass
class Factor:
    """The loop's factor on one micro batch's loss: the gradient that reached its loss's reduction (``value``),
    over the grad scaler's ``scale``."""

    value: float
    scale: float

    @property
    def applied(self) -> float:
        return self.value / self.scale


# ------------------------------------------------------------------------------------------ micro batches


def cpu_copy(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.detach().to("cpu", copy=True)
    if isinstance(batch, Mapping):
        return {k: cpu_copy(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(cpu_copy(v) for v in batch) if isinstance(batch, tuple) else [cpu_copy(v) for v in batch]
    return batch


def rows_of(batch: Any) -> int | None:
    """Examples in a collated batch: the leading size of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else []
    return next((n for v in values if (n := rows_of(v)) is not None), None)


def split(batch: Any, n: int) -> list:
    """A collated batch as ``n`` one-example batches (leading size 1), so a window's examples can be regrouped."""
    def part(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n:
            return value[i:i + 1]
        if isinstance(value, Mapping):
            return {k: part(v, i) for k, v in value.items()}
        if isinstance(value, (list, tuple)) and len(value) == n and not all(isinstance(v, torch.Tensor) for v in value):
            return [value[i]]
        if isinstance(value, tuple):
            return tuple(part(v, i) for v in value)
        return value
    return [part(batch, i) for i in range(n)]


def merge(items: list, key: str = "batch") -> Any:
    """One-example batches as one batch: tensors concatenated, right-padded to the longest where their second size
    differs (labels with -100, masks with 0, ids only where a mask marks the padding)."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        longest = max(t.shape[1] if t.dim() > 1 else 0 for t in items)
        if all(t.shape[1:] == first.shape[1:] for t in items):
            return torch.cat(items)
        if key not in PAD and key != "input_ids":
            raise NotMeasured(f"the loop's micro batches differ in length and '{key}' has no known padding value")
        return torch.cat([torch.nn.functional.pad(t, (0, longest - t.shape[1]), value=PAD.get(key, 0))
                          for t in items])
    if isinstance(first, Mapping):
        if "input_ids" in first and "attention_mask" not in first and len({it["input_ids"].shape[1:]
                                                                          for it in items}) > 1:
            raise NotMeasured("the loop's micro batches differ in length and carry no attention_mask to pad them with")
        return {k: merge([it[k] for it in items], str(k)) for k in first}
    if isinstance(first, tuple):
        return tuple(merge([it[i] for it in items], f"{key}[{i}]") for i in range(len(first)))
    if isinstance(first, list):
        return [v for it in items for v in it]
    if any(it != first for it in items):
        raise NotMeasured(f"'{key}' differs between the loop's micro batches and is not per example")
    return first


def same_input(args: tuple, kwargs: dict, batch: Any) -> bool:
    """Whether a forward's first tensor argument is one of the batch's tensors (by value)."""
    given = next((v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)), None)
    if given is None:
        return False
    pool = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else [batch]
    return any(isinstance(t, torch.Tensor) and t.shape == given.shape and torch.equal(t, given.detach().cpu())
               for t in pool)


@dataclass
class ObservedWindow:
    """One window between two real optimizer steps: its micro batches' examples and, for the first, their
    batches and the loop's factors."""

    examples: list[int] = field(default_factory=list)
    batches: list[Any] = field(default_factory=list)
    factors: list[Factor | None] = field(default_factory=list)
    unmapped: str | None = None  # why a micro batch's examples could not be read


# ------------------------------------------------------------------------------------------ the copy's side


class ObservedView:
    """A framework view whose accumulation window is the loop's own first window: its micro batches (split into
    examples, regrouped by :func:`merge`) and its factors, injected at the loss's reduction of the copy's graph.
    Everything else is the framework view's."""

    def __init__(self, base: Any, window: ObservedWindow) -> None:
        self.base, self.window = base, window
        self.data = replace(base.data, collate=merge)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def accum_windows(self) -> list[Window]:
        w = self.window
        micro = [split(b, n) for b, n in zip(w.batches, w.examples, strict=True)]
        factors = ", ".join(f"{f.applied:.4g}" if f is not None else "?" for f in w.factors)
        label = (f"the loop's first update as it ran: {len(micro)} micro batch(es) before its first optimizer step, "
                 f"each loss multiplied by the loop's factor ({factors})")
        return [Window(WindowKind.OBSERVED, label, micro)]

    def accumulate(self, model, micro: list, device) -> float:
        total = 0.0
        for (_, batch), factor in zip(micro, self.window.factors, strict=True):
            if factor is None:
                raise NotMeasured("a backward of the loop's first window reached no scalar loss (its factor on the "
                                  "loss could not be read)")
            loss = self.base.loss(model, to_device(batch, device))
            chain = chain_of(loss)
            at = reduction_index(chain)
            if at is None:
                raise NotMeasured(f"the loss begin(loss=...) computes ({type(loss).__name__}) has no scalar "
                                  "reduction to compare the loop's factor at")
            watch = Watch(chain[at], inject=factor.applied)
            try:
                loss.backward()
            finally:
                watch.remove()
            total += float(loss.detach()) * factor.applied / (watch.seen or 1.0)
        return total

    def one_batch(self, model, batch, device) -> float:
        return self.base.one_batch(model, batch, device)

    def batching(self) -> Batching:
        return replace(self.base.batching(), grad_accum_steps=len(self.window.examples))

    def scale_cause(self, scale: float, micro_batches: int) -> str | None:
        factors = [f.applied for f in self.window.factors if f is not None]
        if not factors:
            return None
        k = 1.0 / factors[0] if factors[0] else float("inf")
        if abs(k - round(k)) > 1e-3 or round(k) <= micro_batches:
            return None  # not a window cut short: the general causes (a sum of means, a double division) apply
        return (f"the accumulated gradient is exactly {scale:.4g}x the one-batch gradient: the loop divides each micro "
                f"batch's loss by {round(k)} but took its first optimizer step after {micro_batches} micro batch(es) "
                "(an off-by-one in its step condition: `step % accum == 0` is already true at step 0); step after "
                "micro batches accum, 2*accum, ... (`(step + 1) % accum == 0`) or let the framework accumulate "
                "(accelerator.accumulate(model))")


# ------------------------------------------------------------------------------------------ the watcher


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under a framework's wrapper (accelerate's AcceleratedOptimizer, Fabric's)."""
    opt = optimizer
    while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def grads_clear(params: list) -> bool:
    return all(p.grad is None or not bool(p.grad.any()) for p in params)


class StepObserver:
    """Watches a hand-written loop's first :data:`OBSERVED_STEPS` optimizer steps (see the module's docstring) and
    records the ``batch`` and ``accum_equivalence`` rows from them."""

    def __init__(self, job, view: Any, loader: Any, optimizer: Any,
                 loss_scale: Callable[[], float | None]) -> None:
        self.job, self.view, self.loss_scale = job, view, loss_scale
        self.windows: list[ObservedWindow] = []
        self.pending: list[Any] = []
        self.current: ObservedWindow | None = None
        self.recorded: set[str] = set()
        self._undo: list[Callable[[], None]] = []
        model, opt = view.model, inner_optimizer(optimizer)
        if opt is None:
            raise NotMeasured(f"the optimizer ({type(optimizer).__name__}) is not a torch optimizer to watch")
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._undo.append(model.register_forward_pre_hook(_Shared(self._forward), with_kwargs=True).remove)
        self._undo.append(opt.register_step_pre_hook(self._step).remove)
        self._tap(loader)
        self._backward = torch.autograd.backward
        torch.autograd.backward = self._watched_backward
        self._undo.append(self._restore_backward)
        atexit.register(self.finish)

    def _restore_backward(self) -> None:
        if torch.autograd.backward == self._watched_backward:  # bound methods: equal, never identical
            torch.autograd.backward = self._backward

    def _tap(self, loader: Any) -> None:
        """The loader's class gets an ``__iter__`` that hands each batch this loader yields to the watcher (other
        instances pass through); put back at the end. A class, not the instance: ``for`` looks ``__iter__`` up on
        the type, and accelerate's DataLoaderShard refuses a new ``__class__``."""
        cls, observer = type(loader), self
        own = cls.__dict__.get("__iter__")
        inherited = cls.__iter__

        def __iter__(it):
            if it is not loader or not observer._undo:
                yield from inherited(it)
                return
            for batch in inherited(it):
                if len(observer.windows) < OBSERVED_STEPS:
                    observer.pending.append(cpu_copy(batch))
                yield batch

        def untap() -> None:
            if own is not None:
                cls.__iter__ = own
            else:
                delattr(cls, "__iter__")

        cls.__iter__ = __iter__
        self._undo.append(untap)

    # -- the loop's events ------------------------------------------------------------------------------------
    def _forward(self, module, args, kwargs) -> None:
        if module is not self.model or not (module.training and torch.is_grad_enabled()):
            return  # a copy (the checks' own, in eval mode) or an evaluation
        if self.current is None or grads_clear(self.params):
            self.current = ObservedWindow()
        w = self.current
        first = not self.windows
        match = next((i for i, b in enumerate(self.pending) if same_input(args, kwargs, b)),
                     0 if self.pending else None)
        if match is None:
            w.unmapped = w.unmapped or "a training forward came with no batch from the training loader"
            w.examples.append(0)
        else:
            batch = self.pending[match]
            del self.pending[:match + 1]
            w.examples.append(rows_of(batch) or 0)
            if first:
                w.batches.append(batch)
        if first:
            w.factors.append(None)

    def _watched_backward(self, tensors, grad_tensors=None, *args, **kwargs):
        w = self.current
        root = tensors if isinstance(tensors, torch.Tensor) else None
        at = None
        if w is not None and not self.windows and root is not None and grad_tensors is None and w.factors:
            at = reduction_index(chain := chain_of(root))
        if at is None:
            return self._backward(tensors, grad_tensors, *args, **kwargs)
        watch = Watch(chain[at])
        try:
            return self._backward(tensors, grad_tensors, *args, **kwargs)
        finally:
            watch.remove()
            if watch.seen is not None and w is not None and w.factors[-1] is None:
                w.factors[-1] = Factor(watch.seen, self.loss_scale() or 1.0)

    def _step(self, optimizer, args, kwargs) -> None:
        if self.current is None or not self.current.examples:
            return
        self.windows.append(self.current)
        self.current = None
        if len(self.windows) == 1:
            self._record(GateName.ACCUM_EQUIVALENCE, self._accum)
        if len(self.windows) >= OBSERVED_STEPS:
            self.finish()

    # -- the rows -------------------------------------------------------------------------------------------
    def _record(self, gate: str, check: Callable[[], Outcome]) -> None:
        if gate in self.recorded:
            return
        self.recorded.add(gate)
        with rng_untouched(), contextlib.suppress(Exception):
            C.record(self.job, gate, run_check(gate, check))

    def _accum(self) -> Outcome:
        first = self.windows[0]
        factors = [f.applied for f in first.factors if f is not None]
        lone = len(first.examples) == 1 and factors and abs(factors[0] - 1.0) <= 1e-6
        if first.unmapped or len(factors) < len(first.factors) or lone:
            why = ("its first update was one micro batch with its loss unscaled, so the loop itself compares nothing"
                   if lone else first.unmapped or "a backward of its first window reached no scalar loss")
            out = check_accum(self.view)
            out.reason = f"observed: {why}; {out.reason}"
            out.details["observed"] = self._observed()
            return out
        out = check_accum(ObservedView(self.view, first))  # type: ignore[arg-type,unused-ignore]
        out.details["observed"] = self._observed()
        return out

    def _observed(self) -> dict:
        return {"micro_batches_per_update": [len(w.examples) for w in self.windows],
                "examples_per_update": [sum(w.examples) for w in self.windows],
                "first_window_loss_factors": [None if f is None else f.applied
                                              for f in (self.windows[0].factors if self.windows else [])]}

    def _batch(self) -> Outcome:
        setting = self.view.batching()
        if not self.windows:
            out = check_batch(self.view)
            out.warn("the loop took no optimizer step while it was watched: the batch row is the setting's")
            return out
        steady = self.windows[-1]
        observed = replace(setting, grad_accum_steps=len(steady.examples),
                           micro_batch_size=max(steady.examples) or setting.micro_batch_size)
        out = check_batch(_Batched(self.view, observed))
        out.details["observed"] = self._observed()
        out.details["setting"] = {setting.accum_setting: setting.grad_accum_steps}
        counts = [len(w.examples) for w in self.windows]
        out.reason = f"observed over {len(counts)} optimizer step(s) ({'/'.join(map(str, counts))} micro batches): " \
                     f"{out.reason}"
        if len(steady.examples) != setting.grad_accum_steps and setting.grad_accum_steps == 1:
            out.reason += (f"; the loop accumulates {len(steady.examples)} micro batches itself "
                           f"({setting.accum_setting} is 1): every figure above is what it does")
        elif len(steady.examples) != setting.grad_accum_steps:
            _warn(out, f"the loop steps after every {len(steady.examples)} micro batch(es), but "
                       f"{setting.accum_setting} is {setting.grad_accum_steps}: every figure above is the loop's")
        if counts[0] != counts[-1]:
            _warn(out, f"the loop's first optimizer step came after {counts[0]} micro batch(es) and later ones after "
                     f"{counts[-1]}: its step condition is off by one at the start (`step % accum == 0` at step 0)")
        return out

    def finish(self) -> None:
        """Record the batch row from what was seen and take every hook away (at the last watched step, or at exit
        when the loop took fewer)."""
        with contextlib.suppress(Exception):
            atexit.unregister(self.finish)
        undo, self._undo = self._undo, []
        for step in reversed(undo):
            with contextlib.suppress(Exception):
                step()
        self.pending.clear()
        self._record(GateName.ACCUM_EQUIVALENCE, self._accum if self.windows else self._accum_unwatched)
        self._record(GateName.BATCH, self._batch)

    def _accum_unwatched(self) -> Outcome:
        """No real optimizer step was seen (the run ended first): the setting's check, saying so."""
        out = check_accum(self.view)
        out.reason = f"observed: the loop took no optimizer step while watched; as the setting says: {out.reason}"
        return out


def _warn(out: Outcome, text: str) -> None:
    """A warning after the row's own text (``Outcome.warn`` replaces a passing row's reason)."""
    out.warn(f"{out.reason}; {text}" if out.verdict == Verdict.PASS else text)


class _Shared:
    """A hook that a deep copy of the model shares instead of copying (a bound method would copy the watcher, and
    with it the job and the live model)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _Shared:
        return self


class _Batched:
    """A view whose batching is the observed one."""

    def __init__(self, view: Any, batching: Batching) -> None:
        self.view, self._batching = view, batching

    def __getattr__(self, name: str) -> Any:
        return getattr(self.view, name)

    def batching(self) -> Batching:
        return self._batching


def probe_and_watch(job, view: Any, loader: Any, optimizer: Any,
                    loss_scale: Callable[[], float | None]) -> dict[str, Outcome]:
    """The probe gates at ``begin``, then the watcher for batch and accum_equivalence (recorded from the loop's real
    steps); where the optimizer is no torch optimizer to watch, those two are the setting's, as before."""
    from pathlib import Path

    watchable = inner_optimizer(optimizer) is not None
    with rng_untouched():  # the control run then draws what the runs without probes draw
        out = C.run_probes(job, view, Path(job.checkpoint_dir or ".") / "pilotrun-export", observed=watchable)
    if watchable:
        # After the probes: their copies of the model (deep copies) must not carry the watcher's hooks.
        StepObserver(job, view, loader, optimizer, loss_scale)
    return out
