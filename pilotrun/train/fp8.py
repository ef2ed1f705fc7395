"""FP8 training of the model's Linear layers with torchao's float8 (``train.precision: fp8``).

torchao's ``convert_to_float8_training`` swaps each chosen ``nn.Linear`` for a ``Float8Linear``: its three matmuls
(output, input gradient, weight gradient) run on float8 operands scaled per tensor (``tensorwise``, the default
recipe: input and weight in e4m3, the output gradient in e5m2) or per row (``rowwise``: all three in e4m3, scales
rounded to powers of 2), each product accumulated and returned in the high precision. Everything else stays as
``bf16`` trains it: fp32 master weights, gradients and optimizer state, bf16 autocast over the rest of the step.

Which Linears (:func:`choose_linears`): every ``nn.Linear`` except the output head -- torchtitan's float8 setup
filters it out (``filter_fqns: ["output"]``) and the torchao README keeps the final projection in high precision --
and except those whose dimensions are not multiples of 16 (``torch._scaled_mm``'s requirement; torchao's
``_auto_filter_for_recipe`` skips them for the same reason). torchao's size thresholds (N <= 2048 and K <= 1024 not
worth converting on an H100) are a speed heuristic, not a numerics one, and are not applied: a small model's
Linears are converted so the numerics can be measured on it.

torchao 0.18 saves the high-precision input and weight for backward (``float8_linear.py``,
``matmul_with_hp_or_float8_args.forward``: ``ctx.save_for_backward(input_hp, weight_hp_t)``) and casts again in
backward: the float8 copies are temporaries of each matmul, six casts per Linear per micro batch.

Example::

    record = convert_linears(model, "tensorwise")       # Fp8Record(converted=[...], skipped={...})
    fp8_matmul_problem(torch.device("cuda"))             # None where torch._scaled_mm runs, else why not
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..procs import import_noise_quieted

RECIPES = ("tensorwise", "rowwise")
# The attribute names of an output head that a model without get_output_embeddings (a factory's) may use; the
# last part of a Linear's name. torchtitan's float8 filter is "output"; transformers' heads are lm_head, score and
# classifier.
HEAD_NAMES = ("lm_head", "output", "score", "classifier")
MULTIPLE = 16  # torch._scaled_mm needs both dimensions of each operand to be multiples of 16
TORCHAO_HINT = "pip install 'torchao>=0.18' (or pilotrun's fp8 extra: pip install 'pilotrun[fp8]')"


@dataclass
class Fp8Record:
    """What a conversion did: the Linears it converted (their names) and those it skipped, each with why."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def words(self) -> str:
        """One line for a row: how many were converted, or that nothing was (never silent)."""
        total = len(self.converted) + len(self.skipped)
        if not self.converted:
            why = "; ".join(f"{n}: {w}" for n, w in list(self.skipped.items())[:3]) or "the model has no Linear"
            return f"nothing converted to fp8 ({total} Linear(s): {why})"
        reasons = sorted(set(self.skipped.values()))
        return (f"fp8 ({self.recipe}) on {len(self.converted)} of {total} Linear(s)"
                + (f"; skipped {len(self.skipped)}: {'; '.join(reasons)}" if self.skipped else ""))

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "converted": len(self.converted), "skipped": dict(self.skipped)}


def _head_ids(model: torch.nn.Module) -> set[int]:
    """The output head's module (transformers' get_output_embeddings), by identity."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return {id(head)} if isinstance(head, torch.nn.Module) else set()


def choose_linears(model: torch.nn.Module) -> tuple[list[str], dict[str, str]]:
    """(names of the Linears to convert, {name: why not} for the others), in the model's module order. Reads the
    modules' shapes only: works on a meta or fake model (the estimator's trace)."""
    heads = _head_ids(model)
    chosen: list[str] = []
    skipped: dict[str, str] = {}
    for name, mod in model.named_modules():
        if type(mod).__name__ == "Float8Linear":   # converted already (a driver's model)
            chosen.append(name)
            continue
        if not isinstance(mod, torch.nn.Linear):
            continue
        out_f, in_f = mod.weight.shape
        if id(mod) in heads or name.rpartition(".")[2] in HEAD_NAMES:
            skipped[name] = "the output head (kept in high precision, as torchtitan and torchao do)"
        elif in_f % MULTIPLE or out_f % MULTIPLE:
            skipped[name] = f"dimensions {in_f} x {out_f} not multiples of {MULTIPLE} (torch._scaled_mm)"
        else:
            chosen.append(name)
    return chosen, skipped


def torchao_problem() -> str | None:
    """Why torchao's float8 training cannot be imported here, with the fix; None when it can."""
    try:
        _float8()
    except ImportError as exc:
        return f"fp8 needs torchao's float8 training ({exc}); {TORCHAO_HINT}"
    return None


def _float8():
    # torchao logs a warning for each optional compiled extension it cannot load on this machine (CUDA-only kernels
    # on a CPU build) and torch's pytree one for its enum constants: neither concerns float8 training.
    with import_noise_quieted():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return Float8LinearConfig, convert_to_float8_training


def convert_linears(model: torch.nn.Module, recipe: str) -> Fp8Record:
    """Swap the chosen Linears (:func:`choose_linears`) for torchao's Float8Linear in place, with the recipe's
    config (``Float8LinearConfig.from_recipe_name``). Raises ImportError without torchao (check_job refuses first)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; one of {', '.join(RECIPES)}")
    config_class, convert = _float8()
    chosen, skipped = choose_linears(model)
    wanted = set(chosen)
    if wanted:
        convert(model, module_filter_fn=lambda mod, fqn: fqn in wanted,
                config=config_class.from_recipe_name(recipe))
    converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    return Fp8Record(recipe, converted, skipped)


def fp8_matmul_problem(device: torch.device) -> str | None:
    """Why the device cannot run float8 matmuls (``torch._scaled_mm`` on two 16 x 16 float8 operands), or None.
    Asked of torch by running it: CUDA before compute capability 8.9 (A100, V100), MPS and builds without the
    kernel refuse; the CPU runs it (so the numerics can be measured without a GPU)."""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        return f"torch {torch.__version__} has no float8 dtypes"
    try:
        a = torch.ones(MULTIPLE, MULTIPLE, device=device).to(dtype)
        b = torch.ones(MULTIPLE, MULTIPLE, device=device).to(dtype).t()
        one = torch.ones((), device=device)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else type(exc).__name__
        return f"torch._scaled_mm does not run on {device}: {first}"
    return None


def fp8_problems(precision: str, device: torch.device, adapter: object = None,
                 quantization: object = None) -> list[tuple[str, str]]:
    """The spec's problems with ``train.precision: fp8`` on this device, each (field, message naming the fix); []
    for any other precision. Run before anything is built (``drivers.build.check_job``: exit 2)."""
    if precision != "fp8":
        return []
    problems: list[tuple[str, str]] = []
    if (why := torchao_problem()) is not None:
        problems.append(("train.precision", why))
    if (why := fp8_matmul_problem(device)) is not None:
        problems.append(("train.precision", f"fp8 needs float8 matmuls: {why}. Use precision: bf16 here, or run on an "
                                            "accelerator with FP8 (compute capability 8.9+: L4, L40S, H100, H200; "
                                            "MI300X); `pilotrun select` says where FP8 pays"))
    if adapter is not None or quantization is not None:
        key = "model.adapter" if adapter is not None else "model.quantization"
        problems.append((key, "fp8 trains the full model's Linears; with an adapter or a quantised base it is not "
                              "supported: use precision bf16 (or bf16-true) for this job"))
    return problems


def high_precision_linears(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each Float8Linear swapped back for an ``nn.Linear`` holding the same Parameters, in place: for
    a private copy whose check is about the code, not float8's rounding (accum_equivalence's float64 copy: dynamic
    scales taken over a micro batch differ from those over the whole batch, a 1e-2 gradient difference on the demo
    that is float8's, not the loss normalisation's)."""
    for name, mod in list(model.named_modules()):
        if type(mod).__name__ != "Float8Linear":
            continue
        plain = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
        plain.weight, plain.bias = mod.weight, mod.bias
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, plain)
    return model


@contextlib.contextmanager
def linears_in_high_precision(model: torch.nn.Module) -> Iterator[int]:
    """Inside, each Float8Linear of ``model`` runs as the ``nn.Linear`` it was (the same Parameters, no float8
    cast); yields how many. For outputs compared with the export, which holds the weights for high-precision
    inference (reload_eval): float8's rounding is training's, not the artifact's."""
    swapped = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    for mod in swapped:
        mod.forward = types.MethodType(torch.nn.Linear.forward, mod)
    try:
        yield len(swapped)
    finally:
        for mod in swapped:
            del mod.forward
