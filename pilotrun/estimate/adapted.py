"""The estimator's model and optimizer for adapter, quantised and bf16-true jobs, on the meta device.

The trace runs on fake tensors, where bitsandbytes' kernels cannot run. So a quantised Linear is replaced by a
stand-in holding exactly bitsandbytes' storage (``layouts.quantized_linear``: packed weight and quantisation
state, frozen) whose forward and backward allocate the dequantised weight of the layer in flight and free it
after the matmul, as ``MatMul4Bit``/``MatMul8bitFp`` do; the 8-bit optimizers are replaced by a stand-in that
allocates ``layouts.optimizer_state`` and updates in place (the CUDA kernels are fused: no step temporaries).
LoRA itself is the real ``peft`` model (on meta), so frozen parameters have no gradient and no optimizer state.

Dtypes, as the pilot builds the job (``model.quantization`` through transformers' BitsAndBytesConfig):
bf16-true holds every floating tensor in bf16, LoRA matrices included; otherwise LoRA matrices are fp32 (peft's
``autocast_adapter_dtype``), a quantised base's unquantised tensors (embeddings, norms, output head) are in
``quantization.compute_dtype`` (the dtype it is loaded in) and an unquantised base stays fp32.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config.spec import Spec
from . import layouts

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TORCH_NAMES = {torch.uint8: "uint8", torch.int8: "int8", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.float32: "fp32"}


class AdapterTargetError(ValueError):
    """model.adapter.target_modules names no module of the model; the message lists its Linear names."""


@dataclass
class Adaptation:
    """What the estimator changed and counted: shown by estimate/select/plan and the report."""

    base_parameters: int = 0          # the model's own parameters (logical count, before quantisation)
    trainable_parameters: int = 0
    adapter_parameters: int = 0       # LoRA matrices (0 without an adapter)
    adapter_bytes: int = 0
    adapted_layers: int = 0
    quantized_layers: int = 0
    quantized_bytes: int = 0          # packed weights + quantisation state of every quantised Linear
    dequantized_peak_bytes: int = 0   # the largest layer's dequantised weight (one layer in flight)
    merged_bytes: int = 0             # export.merge: the merged model's size
    notes: list[str] = field(default_factory=list)


class _DequantMatmul(torch.autograd.Function):
    """y = x W^T (+ b) with W dequantised for the matmul only: bitsandbytes keeps the packed weight for backward
    and dequantises it again there."""

    @staticmethod
    def forward(ctx, x, packed, bias, out_features: int, in_features: int, dtype, keep_input: bool):
        w = torch.empty((out_features, in_features), dtype=dtype, device=x.device)
        y = torch.nn.functional.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))
        del w
        ctx.shape = (out_features, in_features)
        # MatMul8bitFp keeps its input on ctx (ctx.A) although the frozen weight needs no gradient.
        ctx.save_for_backward(packed, x if keep_input else None)
        return y

    @staticmethod
    def backward(ctx, grad):
        w = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        return grad @ w, None, None, None, None, None, None


class QuantizedLinearStandIn(torch.nn.Module):
    """A frozen Linear with bitsandbytes' storage (every piece a frozen parameter, so it is counted as the
    model's) and its dequantised temporaries in flight."""

    def __init__(self, linear: torch.nn.Linear, bits: int, double_quant: bool, compute_dtype: torch.dtype,
                 base_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bits = bits
        self.compute_dtype = compute_dtype
        pieces = layouts.quantized_linear(bits, self.out_features, self.in_features, double_quant)
        dtypes = {"uint8": torch.uint8, "int8": torch.int8, "fp32": torch.float32}
        for piece in pieces:
            t = torch.empty(piece.numel, dtype=dtypes[piece.dtype], device="meta")
            self.register_parameter(piece.name.replace(".", "_"), torch.nn.Parameter(t, requires_grad=False))
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(
            torch.empty(bias.shape, dtype=base_dtype, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # 4-bit: Linear4bit casts the input to compute_dtype and the output back; 8-bit works in the input's dtype.
        dtype = self.compute_dtype if self.bits == 4 else x.dtype
        y = _DequantMatmul.apply(x, self.weight, self.bias, self.out_features, self.in_features, dtype,
                                 self.bits == 8)
        return y.to(x.dtype)


def _linear_names(model: torch.nn.Module) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def _apply_lora(model: torch.nn.Module, spec: Spec) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    a = spec.model.adapter
    assert a is not None
    targets = a.target_modules if isinstance(a.target_modules, str) else list(a.target_modules)
    if isinstance(targets, list):
        known = set(_linear_names(model))
        missing = [t for t in targets if t not in known]
        if missing:
            raise AdapterTargetError(f"model.adapter.target_modules: {missing} are not Linear modules of this model; "
                                     f"its Linear module names are {sorted(known)} (or use all-linear)")
    # peft annotates lora_alpha as int but only computes alpha / r with it: the spec's float is kept.
    config = LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout,  # type: ignore[arg-type]
                        target_modules=targets)
    return get_peft_model(model, config)


def _is_lora_part(name: str) -> bool:
    return any(part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B") for part in name.split("."))


def _quantize(model: torch.nn.Module, spec: Spec, base_dtype: torch.dtype, out: Adaptation) -> None:
    """Replace every Linear transformers would quantise (all but the output head and LoRA's own) by a stand-in."""
    q = spec.model.quantization
    assert q is not None
    compute = DTYPES[q.compute_dtype]
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    swaps = [(name, m) for name, m in model.named_modules()
             if type(m) is torch.nn.Linear and m is not head and not _is_lora_part(name)
             and not name.endswith("lm_head") and not name.endswith("score")]
    for name, linear in swaps:
        owner, _, attr = name.rpartition(".")
        stand_in = QuantizedLinearStandIn(linear, q.bits, q.double_quant, compute, base_dtype)
        setattr(model.get_submodule(owner) if owner else model, attr, stand_in)
        out.quantized_layers += 1
        out.quantized_bytes += sum(p.numel() * p.element_size() for p in stand_in.parameters()
                                   if p is not stand_in.bias)
        temp_dtype = compute if q.bits == 4 else base_dtype
        out.dequantized_peak_bytes = max(out.dequantized_peak_bytes, linear.in_features * linear.out_features
                                         * torch.empty((), dtype=temp_dtype).element_size())


def adapt(model: torch.nn.Module, spec: Spec) -> tuple[torch.nn.Module, Adaptation]:
    """The meta model as the pilot trains it: adapter, quantised base and dtypes applied."""
    out = Adaptation()
    out.base_parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    precision = spec.train.precision
    quant = spec.model.quantization
    if precision == "bf16-true":
        base_dtype = torch.bfloat16
    elif quant is not None:
        base_dtype = DTYPES[quant.compute_dtype]
    else:
        base_dtype = torch.float32
    # Parameters only: transformers keeps buffers such as rotary inv_freq in fp32 when it loads in a dtype.
    for p in model.parameters():
        p.data = p.data.to(base_dtype)
    merged_dtype = base_dtype
    if spec.model.adapter is not None:
        model = _apply_lora(model, spec)
        lora = [(n, p) for n, p in model.named_parameters() if _is_lora_part(n)]
        if precision == "bf16-true":
            for _, p in lora:
                p.data = p.data.to(torch.bfloat16)
        out.adapter_parameters = sum(p.numel() for _, p in lora)
        out.adapter_bytes = sum(p.numel() * p.element_size() for _, p in lora)
        out.adapted_layers = sum(1 for n, _ in lora if n.split(".")[-2] == "default" and "lora_A" in n)
        out.notes.append(f"LoRA r={spec.model.adapter.r} on {out.adapted_layers} Linear layers: "
                         f"{out.adapter_parameters:,} trainable parameters; the base is frozen (no gradients, "
                         "no optimizer state)")
    if quant is not None:
        _quantize(model, spec, base_dtype, out)
        out.notes.append(f"{quant.bits}-bit base: {out.quantized_layers} Linear layers held as bitsandbytes "
                         "stores them (packed weights + quantisation state), each dequantised only while in flight")
        # Merging into a quantised base dequantises it: the merged model is written in the compute dtype.
        merged_dtype = DTYPES[quant.compute_dtype]
    out.trainable_parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
                                   if p.requires_grad)
    if spec.export.merge:
        out.merged_bytes = out.base_parameters * torch.empty((), dtype=merged_dtype).element_size()
    return model, out


class StateSizedOptimizer(torch.optim.Optimizer):
    """bitsandbytes' 8-bit AdamW as the trace sees it: its state per ``layouts.optimizer_state`` (the 256-value
    maps shared), an in-place update, no step temporaries (the CUDA kernel is one fused blockwise update)."""

    def __init__(self, params, name: str, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.kind = name
        self._shared: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        dtypes = {"uint8": torch.uint8, "fp32": torch.float32}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    for piece in layouts.optimizer_state(self.kind, tuple(p.shape), TORCH_NAMES[p.dtype]):
                        state[piece.name] = torch.zeros(piece.numel, dtype=dtypes[piece.dtype], device=p.device)
                    if p.numel() >= layouts.MIN_8BIT_SIZE:
                        for piece in layouts.optimizer_shared(self.kind):
                            if piece.name not in self._shared:
                                self._shared[piece.name] = torch.zeros(piece.numel, dtype=dtypes[piece.dtype],
                                                                       device=p.device)
                            state[piece.name] = self._shared[piece.name]
                p.add_(p.grad, alpha=-group["lr"])
        return None


def trace_optimizer(model: torch.nn.Module, spec: Spec, target: str) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer the trace steps, and how it runs on ``target`` (for the notes)."""
    from ..train.optim import build_optimizer, param_groups

    o = spec.train.optimizer
    if o.name in ("adamw8bit", "paged_adamw8bit"):
        groups = param_groups(model, o.weight_decay)
        return StateSizedOptimizer([g for g in groups if g["params"]], o.name, o.lr), (
            f"{o.name}: bitsandbytes' state sizes (estimate/layouts.py), fused in-place update")
    if o.name == "adafactor":
        from transformers.optimization import Adafactor

        groups = param_groups(model, o.weight_decay)
        opt: torch.optim.Optimizer = Adafactor([g for g in groups if g["params"]], lr=o.lr, beta1=None,
                                               relative_step=False, scale_parameter=False, warmup_init=False)
        return opt, "adafactor (transformers), factored second moment, no first moment"
    opt = build_optimizer(model, o)
    fused = o.name == "adamw" and o.fused is True
    for group in opt.param_groups:
        if fused:
            group["fused"], group["foreach"] = True, False
        else:
            group["foreach"] = target != "cpu"  # CUDA's default multi-tensor path, with its temporaries
    return opt, ("adamw fused (no step temporaries)" if fused else
                 f"{o.name} {'foreach' if target != 'cpu' else 'per-parameter'} path")
