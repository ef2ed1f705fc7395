"""Storage layouts the estimator cannot trace for real: a bitsandbytes-quantised Linear and each optimizer's
state. One table each, with its source; the trace (``estimate/adapted.py``) allocates exactly these tensors, and
the 8B example's README and tests check them by hand.

Quantised weights (bitsandbytes 0.50.2, ``functional.quantize_4bit`` / ``nn.Linear8bitLt``; read from the
installed package and measured on CPU with transformers' ``BitsAndBytesConfig``,
``tests/estimate/test_estimate_adapters.py``):

=====================  ===========================================================================================
4-bit (nf4 / fp4)      packed weight: uint8, ceil(out*in / 2) (two 4-bit codes per byte, shape [n/2, 1]);
                       ``quant_state.absmax``: one scale per block of 64 weights (``blocksize`` default 64),
                       fp32 ceil(n/64) -- or, with double quantisation (``compress_statistics``), uint8 ceil(n/64)
                       plus ``state2.absmax`` fp32 ceil(n/64/256) (second-level blocksize 256), ``state2.code``
                       256 fp32 (the dynamic map) and ``offset`` one fp32; ``code`` 16 fp32 (the nf4/fp4 map).
8-bit (LLM.int8)       int8 weight out*in; ``SCB`` fp32 per output row.
in flight              4-bit: ``MatMul4Bit`` dequantises the layer's weight to the compute dtype for the matmul
                       (``gemm_4bit``) and again in backward (``dequantize_4bit(B).to(grad.dtype)``), keeping only
                       the packed weight between them; 8-bit: ``MatMul8bitFp`` (CPU/XPU) and ``MatMul8bitLt``'s
                       backward build ``CB.to(dtype_A) * SCB / 127``, one out*in temporary in the input's dtype.
=====================  ===========================================================================================

Optimizer state per trainable parameter of shape S, numel n (measured on CPU with the installed torch 2.13,
bitsandbytes 0.50.2 and transformers 5.24 in ``tests/estimate/test_estimate_adapters.py``):

==================  ========================================================================================
adamw (torch)       exp_avg + exp_avg_sq in the parameter's dtype (2 x 4 B fp32, 2 x 2 B under bf16-true),
                    ``step`` one fp32 scalar (torch/optim/adamw.py ``_init_group``)
sgd                 momentum_buffer in the parameter's dtype when momentum > 0, else nothing
adamw8bit,          n >= min_8bit_size (4096): state1 + state2 uint8 n each, absmax1 + absmax2 fp32 per block of
paged_adamw8bit     256 (ceil(n/256) each), qmap1 + qmap2 256 fp32 shared by every parameter of the optimizer;
                    n < 4096: state1 + state2 fp32 n each, whatever the parameter's dtype
                    (bitsandbytes/optim/optimizer.py ``Optimizer2State.init_state``). Paged state lives in CUDA
                    unified memory on a GPU (evicted to host under pressure); on CPU it is ordinary memory.
adafactor           ndim >= 2: exp_avg_sq_row fp32 S[:-1] + exp_avg_sq_col fp32 S[:-2]+S[-1:]; ndim < 2:
(transformers)      exp_avg_sq fp32 n; ``RMS`` one fp32; exp_avg fp32 n only when beta1 is set (pilotrun builds
                    it with beta1=None) (transformers/optimization.py ``Adafactor.step``)
==================  ========================================================================================
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BLOCK_4BIT = 64          # bitsandbytes quantize_4bit default blocksize (CUDA and CPU, 0.50.2)
BLOCK_4BIT_NESTED = 256  # second-level blocksize of double quantisation (MatMul4Bit requires 256)
BLOCK_8BIT_OPTIM = 256   # Optimizer2State blockwise state: one absmax per 256 values
MIN_8BIT_SIZE = 4096     # parameters smaller than this keep 32-bit state in the 8-bit optimizers
QMAP_VALUES = 256        # dynamic quantisation map of the 8-bit optimizers, fp32

DTYPE_BYTES = {"uint8": 1, "int8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Piece:
    """One stored tensor: name, element count, dtype name (keys of DTYPE_BYTES)."""

    name: str
    numel: int
    dtype: str

    @property
    def bytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def quantized_linear(bits: int, out_features: int, in_features: int, double_quant: bool = True) -> list[Piece]:
    """The stored tensors of one bitsandbytes-quantised Linear(in, out) (its bias is not quantised)."""
    n = out_features * in_features
    if bits == 8:
        return [Piece("weight", n, "int8"), Piece("SCB", out_features, "fp32")]
    blocks = math.ceil(n / BLOCK_4BIT)
    pieces = [Piece("weight", math.ceil(n / 2), "uint8"), Piece("code", 16, "fp32")]
    if double_quant:
        pieces += [Piece("absmax", blocks, "uint8"), Piece("offset", 1, "fp32"),
                   Piece("state2.absmax", math.ceil(blocks / BLOCK_4BIT_NESTED), "fp32"),
                   Piece("state2.code", 256, "fp32")]
    else:
        pieces.append(Piece("absmax", blocks, "fp32"))
    return pieces


def optimizer_state(name: str, shape: tuple[int, ...], dtype: str, momentum: float = 0.0) -> list[Piece]:
    """The state one parameter of ``shape`` and ``dtype`` gets from optimizer ``name`` (spec names).

    The 8-bit optimizers' two quantisation maps are shared by all parameters: :func:`optimizer_shared`."""
    n = math.prod(shape)
    if name == "adamw":
        return [Piece("exp_avg", n, dtype), Piece("exp_avg_sq", n, dtype), Piece("step", 1, "fp32")]
    if name == "sgd":
        return [Piece("momentum_buffer", n, dtype)] if momentum else []
    if name in ("adamw8bit", "paged_adamw8bit"):
        if n < MIN_8BIT_SIZE:
            return [Piece("state1", n, "fp32"), Piece("state2", n, "fp32")]
        blocks = math.ceil(n / BLOCK_8BIT_OPTIM)
        return [Piece("state1", n, "uint8"), Piece("state2", n, "uint8"),
                Piece("absmax1", blocks, "fp32"), Piece("absmax2", blocks, "fp32")]
    if name == "adafactor":
        if len(shape) >= 2:
            return [Piece("exp_avg_sq_row", math.prod(shape[:-1]), "fp32"),
                    Piece("exp_avg_sq_col", math.prod(shape[:-2]) * shape[-1], "fp32"), Piece("RMS", 1, "fp32")]
        return [Piece("exp_avg_sq", n, "fp32"), Piece("RMS", 1, "fp32")]
    raise ValueError(f"unknown optimizer {name!r}")


def optimizer_shared(name: str) -> list[Piece]:
    """State held once per optimizer, whatever the number of parameters."""
    if name in ("adamw8bit", "paged_adamw8bit"):
        return [Piece("qmap1", QMAP_VALUES, "fp32"), Piece("qmap2", QMAP_VALUES, "fp32")]
    return []


def optimizer_state_bytes(name: str, shapes: list[tuple[tuple[int, ...], str]], momentum: float = 0.0) -> int:
    """Total state bytes of optimizer ``name`` over trainable parameters given as (shape, dtype)."""
    total = sum(p.bytes for shape, dtype in shapes for p in optimizer_state(name, shape, dtype, momentum))
    # The 8-bit maps exist only once some parameter is large enough to be kept in 8 bits.
    if any(math.prod(s) >= MIN_8BIT_SIZE for s, _ in shapes):
        total += sum(p.bytes for p in optimizer_shared(name))
    return total


def lora_parameters(r: int, in_features: int, out_features: int) -> int:
    """LoRA's trainable parameters on one Linear: A is r x in, B is out x r."""
    return r * (in_features + out_features)
