"""A quantised frozen base (bitsandbytes through transformers' ``BitsAndBytesConfig``) and the one answer to
"does this machine have the kernel for it?".

What bitsandbytes 0.50 runs on CPU, found by running each operation here (see
tests/models/test_adapters.py, which runs every path this table calls available):

| operation | cpu | cuda | source |
| --- | --- | --- | --- |
| 4-bit matmul (Linear4bit nf4/fp4, double quant), fwd + bwd | yes | yes | bitsandbytes/backends/cpu |
| 8-bit matmul (Linear8bitLt, LLM.int8), fwd + bwd | yes | yes | bitsandbytes/backends/cpu |
| 8-bit optimizer state (AdamW8bit) | yes | yes | bitsandbytes/backends/cpu, 8-bit blockwise update |
| paged optimizer state (PagedAdamW8bit) | no (1) | yes | bitsandbytes/optim/optimizer.py ``get_state_buffer`` |

(1) On CPU PagedAdamW8bit runs, but its state is ordinary host memory, never paged (measured here: no
``is_paged`` tensor in its state): the paging a user rents it for cannot be observed, so it is "not measured".

On a CPU with AVX512-BF16, bitsandbytes 0.50.2 repacks a 4-bit weight in place (to bf16 scales) on its first
eval-mode forward (``Linear4bit.forward`` -> ``functional._convert_weight_packed_for_cpu``), and from then on every
forward, training included, goes through ``gemv_4bit``, which has no autograd kernel: gradients no longer flow
through the base to earlier layers (torch warns "silently incorrect behavior"; measured here: after one eval
forward, a first-layer LoRA gradient differs by as much as its own size). Training after evaluation — what every
pilot and run does — would be wrong, so :func:`keep_training_path` turns that repacking off (it also asserts
``out_features % 32 == 0``, a shape limit that then no longer applies).
"""
from __future__ import annotations

import contextlib
import enum
import importlib.metadata
import tempfile
from typing import Any

import torch

from ..config.sections import BNB_OPTIMIZERS, OptimizerSpec, QuantizationSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Kernel(str, enum.Enum):
    """A bitsandbytes operation a job may need; :func:`kernel_problem` says whether this machine has it."""

    MATMUL_4BIT = "4-bit matmul"
    MATMUL_8BIT = "8-bit matmul"
    OPTIMIZER_8BIT = "8-bit optimizer state"
    PAGED_STATE = "paged optimizer state"


# Device types each operation runs on, by bitsandbytes' own backends (table above). CPU pages nothing.
SUPPORTED: dict[Kernel, frozenset[str]] = {
    Kernel.MATMUL_4BIT: frozenset({"cpu", "cuda", "xpu"}),
    Kernel.MATMUL_8BIT: frozenset({"cpu", "cuda", "xpu"}),
    Kernel.OPTIMIZER_8BIT: frozenset({"cpu", "cuda", "xpu"}),
    Kernel.PAGED_STATE: frozenset({"cuda"}),
}
# The device an operation needs, named in the "not measured" line.
NEEDS = {Kernel.PAGED_STATE: "cuda"}


def bnb_version() -> str | None:
    try:
        return importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return None


def kernel_problem(kernel: Kernel, device_type: str) -> str | None:
    """None when ``kernel`` runs on ``device_type`` here; else the row's reason, ``not measured: <operation> needs
    <device> (bitsandbytes <version>)``. The one place availability is decided (tests patch it)."""
    version = bnb_version()
    if version is None:
        return (f"not measured: {kernel.value} needs bitsandbytes, which is not installed "
                "(pip install 'pilotrun[quant]')")
    if device_type in SUPPORTED[kernel]:
        return None
    return f"not measured: {kernel.value} needs {NEEDS.get(kernel, 'cuda')} (bitsandbytes {version})"


def kernels_needed(q: QuantizationSpec | None, optimizer: OptimizerSpec) -> list[Kernel]:
    """The bitsandbytes operations a job runs: its base's (``model.quantization``) and its optimizer's
    (``train.optimizer``)."""
    out = []
    if q is not None:
        out.append(Kernel.MATMUL_4BIT if q.bits == 4 else Kernel.MATMUL_8BIT)
    if optimizer.name in BNB_OPTIMIZERS:
        out.append(Kernel.OPTIMIZER_8BIT)
    if optimizer.name == "paged_adamw8bit":
        out.append(Kernel.PAGED_STATE)
    return out


class KernelUnavailable(RuntimeError):
    """An operation the job needs has no kernel on this device; ``reason`` is the row's "not measured" line."""

    def __init__(self, kernel: Kernel, reason: str) -> None:
        super().__init__(reason)
        self.kernel = kernel
        self.reason = reason


def require_kernels(kernels: list[Kernel], device_type: str) -> None:
    """Raise :class:`KernelUnavailable` for the first of ``kernels`` (:func:`kernels_needed`) that this device
    lacks."""
    for kernel in kernels:
        problem = kernel_problem(kernel, device_type)
        if problem is not None:
            raise KernelUnavailable(kernel, problem)


def keep_training_path(model: torch.nn.Module) -> int:
    """Turn off bitsandbytes' CPU eval-time repacking of 4-bit weights (see the module's docstring) on every layer
    that has it; returns how many layers had it on."""
    n = 0
    for mod in model.modules():
        if getattr(mod, "support_avx512bf16_for_cpu", False):
            setattr(mod, "support_avx512bf16_for_cpu", False)  # noqa: B010 - a library attribute torch types cannot see
            n += 1
    return n


def bnb_config(q: QuantizationSpec):
    """transformers' BitsAndBytesConfig for the spec's ``model.quantization``."""
    from transformers import BitsAndBytesConfig

    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.type, bnb_4bit_use_double_quant=q.double_quant,
                              bnb_4bit_compute_dtype=DTYPES[q.compute_dtype])


def quantized_from_config(cls, model: torch.nn.Module, q: QuantizationSpec, device: torch.device | str = "cpu"):
    """A randomly initialised model (built from a config, seeded) quantised the only way transformers quantises:
    through ``from_pretrained``. Its fp32 weights go through a private temporary folder that is removed at once,
    so the quantised base is a function of the seed alone (the restore and resume proofs rebuild it)."""
    with tempfile.TemporaryDirectory(prefix="pilotrun-quant-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
        return quantized_from_pretrained(cls, tmp, q, device)


def quantized_from_pretrained(cls, source: str, q: QuantizationSpec, device: torch.device | str = "cpu",
                              **kwargs: Any):
    """``cls.from_pretrained`` with the spec's BitsAndBytesConfig, placed on ``device`` as it loads."""
    device_map = {"": str(device)}
    with contextlib.redirect_stdout(None):  # bitsandbytes prints CPU notes on import
        return cls.from_pretrained(source, quantization_config=bnb_config(q), device_map=device_map, **kwargs)


def is_quantized(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "is_quantized", False) or getattr(model, "is_loaded_in_4bit", False)
                or getattr(model, "is_loaded_in_8bit", False))
