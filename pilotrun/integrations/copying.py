"""Copies of a framework's model that are really separate, and the model's own forward without a program's wrappers.

Frameworks patch ``forward`` on the instance: accelerate wraps it in autocast (``Trainer(bf16=True)``), TRL's
``SFTTrainer``/``DPOTrainer`` replace it with a fused-LM-head forward that closes over the *original* model's bound
``forward``. ``copy.deepcopy`` copies modules but shares functions, so the copy's patched forward still calls the
original model — in train mode, with dropout on, and a probe that trains the copy puts gradients on the live model
(found piloting a TRL ``SFTTrainer``). :func:`own_copy` rebuilds those wrappers so that every reference to the
original reaches the copy instead; :func:`class_forward` runs the class's own forward, as an artifact reloaded in a
fresh process has it.
"""
from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Iterator
from typing import Any, TypeVar

import torch

# Wrappers nest a few levels (accelerate: fp32-outputs → autocast → TRL's fused forward → the bound forward).
_DEPTH = 8


def patched_forwards(model: torch.nn.Module) -> list[str]:
    """The modules (by name, "" for the model itself) whose ``forward`` is set on the instance, not the class, by a
    wrapper for training. accelerate's device-placement hooks (device_map, CPU offload: ``_hf_hook``) are how the
    weights are reached, not such a wrapper, and are left out."""
    return [name for name, m in model.named_modules() if "forward" in vars(m) and not hasattr(m, "_hf_hook")]


M = TypeVar("M", bound=torch.nn.Module)


def own_copy(model: M) -> M:
    """A deep copy whose instance-level forwards call the copy, never the original (see the module docstring)."""
    memo: dict[int, Any] = {}
    out = copy.deepcopy(model, memo)
    for m in out.modules():
        if "forward" in vars(m):
            m.forward = _rebound(vars(m)["forward"], memo, _DEPTH)
        for hooks in (m._forward_pre_hooks, m._forward_hooks):  # a hook closing over its module, likewise
            for key, hook in list(hooks.items()):
                hooks[key] = _rebound(hook, memo, _DEPTH)
    return out


def _rebound(obj: Any, memo: dict[int, Any], depth: int) -> Any:
    """``obj`` with every original object the copy replaced (by ``memo``) swapped for its copy; ``obj`` itself when
    nothing in it refers to one."""
    if id(obj) in memo:
        return memo[id(obj)]
    if depth <= 0:
        return obj
    if isinstance(obj, types.MethodType):
        func, owner = _rebound(obj.__func__, memo, depth - 1), _rebound(obj.__self__, memo, depth - 1)
        return obj if func is obj.__func__ and owner is obj.__self__ else types.MethodType(func, owner)
    if isinstance(obj, types.FunctionType):
        return _rebound_function(obj, memo, depth)
    if type(obj) in (list, tuple):  # a closure over a list of modules
        items = [_rebound(v, memo, depth - 1) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    if type(obj) is dict:
        values = {k: _rebound(v, memo, depth - 1) for k, v in obj.items()}
        return obj if all(values[k] is v for k, v in obj.items()) else type(obj)(values)
    if callable(obj) and not isinstance(obj, (type, torch.nn.Module, types.BuiltinFunctionType)) \
            and hasattr(obj, "__dict__"):
        # A callable wrapper object (accelerate's ConvertOutputsToFp32 holds the forward it wraps as an attribute).
        changed = {k: _rebound(v, memo, depth - 1) for k, v in vars(obj).items()}
        if all(changed[k] is v for k, v in vars(obj).items()):
            return obj
        new = object.__new__(type(obj))  # not copy.copy: accelerate's wrapper refuses to be pickled
        vars(new).update(changed)
        return new
    return obj


def _rebound_function(fn: types.FunctionType, memo: dict[int, Any], depth: int) -> types.FunctionType:
    cells = fn.__closure__ or ()
    contents = []
    for cell in cells:
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell (a name assigned later in the enclosing function)
            contents.append(cell)
    new_contents = [c if isinstance(c, types.CellType) else _rebound(c, memo, depth - 1) for c in contents]
    attrs = {k: _rebound(v, memo, depth - 1) for k, v in vars(fn).items()}  # functools.wraps' __wrapped__
    defaults = _rebound(fn.__defaults__, memo, depth - 1) if fn.__defaults__ else fn.__defaults__  # _f=m.forward
    kwdefaults = _rebound(fn.__kwdefaults__, memo, depth - 1) if fn.__kwdefaults__ else fn.__kwdefaults__
    if (all(a is b for a, b in zip(new_contents, contents)) and all(attrs[k] is v for k, v in vars(fn).items())
            and defaults is fn.__defaults__ and kwdefaults is fn.__kwdefaults__):
        return fn
    closure = tuple(c if isinstance(c, types.CellType) else types.CellType(c) for c in new_contents)
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults, closure or None)
    new.__kwdefaults__ = kwdefaults
    new.__qualname__ = fn.__qualname__
    vars(new).update(attrs)
    return new


@contextlib.contextmanager
def class_forward(model: torch.nn.Module) -> Iterator[list[str]]:
    """Within: every module of ``model`` runs its class's ``forward`` (instance-level patches set aside and put back
    on exit), in eval mode, each module's train/eval flag restored after. Yields the names of the patched modules.

    The reload in a fresh process has no wrapper a program set up (accelerate's autocast, TRL's fused head), so the
    outputs it is compared with come from the same function on the same weights, in the weights' own precision."""
    modules = dict(model.named_modules())
    saved = {name: modules[name].__dict__.pop("forward") for name in patched_forwards(model)}
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield sorted(saved)
    finally:
        for m, training in modes:
            m.training = training
        for name, fwd in saved.items():
            modules[name].forward = fwd
