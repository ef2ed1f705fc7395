"""The estimator's model and optimizer for adapter, quantised and bf16-weight jobs, on the meta device.

The trace runs on fake tensors, where bitsandbytes' kernels cannot run. So a quantised Linear is replaced by a
stand-in holding exactly bitsandbytes' storage (``layouts.quantized_linear``: packed weight and quantisation
state, frozen) whose forward and backward allocate the dequantised weight of the layer in flight and free it
after the matmul, as ``MatMul4Bit``/``MatMul8bitFp`` do; the 8-bit optimizers are replaced by a stand-in that
allocates ``layouts.optimizer_state`` and updates in place (the CUDA kernels are fused: no step temporaries).
LoRA itself is the real ``peft`` model (on meta), so frozen parameters have no gradient and no optimizer state.

Dtypes, as the pilot builds the job (``models.loading.build_model``, which also builds the estimator's meta model):
bf16-true holds every floating tensor in bf16, LoRA matrices included; bf16-true-autocast holds the base in bf16 and
the LoRA matrices in fp32 (peft's ``autocast_adapter_dtype``, as a program that loads its model in bf16 and calls
``get_peft_model`` has them); otherwise LoRA matrices are fp32 and a quantised base's unquantised tensors (embeddings,
norms, output head) are fp32 after peft's ``prepare_model_for_kbit_training`` (``model.quantization.prepare: peft``)
or in the compute dtype without it (``prepare: none``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config.sections import BF16_WEIGHTS
from ..config.spec import Spec
from . import layouts

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TORCH_NAMES = {torch.uint8: "uint8", torch.int8: "int8", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.float32: "fp32"}


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
    # Of quantized_bytes, the quantisation state (absmax, codes, SCB): attributes of bitsandbytes' parameters, not
    # parameters, so a sharding strategy neither shards nor offloads them (strategies/fsdp.py).
    quant_state_bytes: int = 0
    dequantized_peak_bytes: int = 0   # the largest layer's dequantised weight (one layer in flight)
    merged_bytes: int = 0             # export.merge: the merged model's size
    preparation: str = ""             # a quantised base: the QLoRA preparation modelled (peft, none, or not applied)
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


def fsdp_parts(model: torch.nn.Module, block_name: str) -> dict[str, dict[str, int]]:
    """Parameter bytes as FSDP2 moves them, for the largest repeated block (``block_name``, as
    ``models.structure.largest_block`` names it: the unit gathered at once), everything outside the blocks (``root``)
    and the ``model``: ``fp32``, float parameters stored in fp32 (a 2-byte MixedPrecisionPolicy gathers them at half);
    ``stored``, every other parameter, gathered as stored (bf16/fp16 floats, a quantised base's packed weights);
    ``state``, a quantised base's absmax and codes (bitsandbytes keeps them as attributes, not parameters: never
    gathered, whole on every rank); ``trainable``, the bytes that require grad (frozen weights make no gradient)."""
    from ..models.structure import repeated_blocks
    from .cache import FSDP_PART_KINDS

    def parts(module: torch.nn.Module, skip: set[int]) -> dict[str, int]:
        out = dict.fromkeys(FSDP_PART_KINDS, 0)
        for m in module.modules():
            for name, p in m.named_parameters(recurse=False):
                if id(p) in skip:
                    continue
                skip.add(id(p))
                n = p.numel() * p.element_size()
                state = isinstance(m, QuantizedLinearStandIn) and name not in ("weight", "bias")
                out["state" if state else "fp32" if p.dtype == torch.float32 else "stored"] += n
                out["trainable"] += n if p.requires_grad else 0
        return out

    whole = parts(model, set())
    _, blocks = repeated_blocks(model)
    if len(blocks) < 2:   # largest_block's "(whole model)"
        return {"block": whole, "root": dict.fromkeys(FSDP_PART_KINDS, 0), "model": whole}
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    return {"block": parts(model.get_submodule(block_name), set()), "root": parts(model, in_blocks), "model": whole}


def _quantize(model: torch.nn.Module, spec: Spec, base_dtype: torch.dtype, out: Adaptation) -> None:
    """Replace every Linear transformers would quantise (all but the output head and LoRA's own) by a stand-in."""
    from ..models.adapters import is_adapter_parameter

    q = spec.model.quantization
    assert q is not None
    compute = DTYPES[q.compute_dtype]
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    swaps = [(name, m) for name, m in model.named_modules()
             if type(m) is torch.nn.Linear and m is not head and not is_adapter_parameter(name + ".weight")
             and not name.endswith("lm_head") and not name.endswith("score")]
    for name, linear in swaps:
        owner, _, attr = name.rpartition(".")
        stand_in = QuantizedLinearStandIn(linear, q.bits, q.double_quant, compute, base_dtype)
        setattr(model.get_submodule(owner) if owner else model, attr, stand_in)
        out.quantized_layers += 1
        out.quantized_bytes += sum(p.numel() * p.element_size() for p in stand_in.parameters()
                                   if p is not stand_in.bias)
        out.quant_state_bytes += sum(p.numel() * p.element_size() for n, p in stand_in.named_parameters()
                                     if n not in ("weight", "bias"))
        temp_dtype = compute if q.bits == 4 else base_dtype
        out.dequantized_peak_bytes = max(out.dequantized_peak_bytes, linear.in_features * linear.out_features
                                         * torch.empty((), dtype=temp_dtype).element_size())


def _prepared(model: torch.nn.Module, spec: Spec, base_dtype: torch.dtype, out: Adaptation) -> torch.dtype:
    """The dtype of a quantised base's unquantised tensors under its QLoRA preparation (``model.quantization.prepare``),
    the base's floating parameters cast to it (the meta build holds them in fp32, as peft's upcast leaves them), and
    the note that says which preparation was modelled."""
    from ..models.adapters import is_adapter_parameter

    q = spec.model.quantization
    assert q is not None
    if spec.train.precision in BF16_WEIGHTS:
        out.preparation = f"not applied ({spec.train.precision}: the base's unquantised tensors in bf16)"
    elif q.prepare == "none":
        base_dtype = DTYPES[q.compute_dtype]
        out.preparation = (f"none (model.quantization.prepare: none): the base's unquantised tensors (embeddings, "
                           f"norms, output head) held in the compute dtype, {q.compute_dtype}")
    else:
        out.preparation = ("peft (model.quantization.prepare: peft): prepare_model_for_kbit_training upcasts the "
                           "base's unquantised tensors (embeddings, norms, output head) to fp32")
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != base_dtype and not is_adapter_parameter(name):
            p.data = p.data.to(base_dtype)
    out.notes.append(f"QLoRA preparation modelled: {out.preparation}")
    return base_dtype


def adapt(model: torch.nn.Module, spec: Spec) -> tuple[torch.nn.Module, Adaptation]:
    """The meta model as the pilot trains it. ``models.loading.build_model(meta=True)`` already applied the adapter
    (peft) and the bf16 weights of bf16-true(-autocast); bitsandbytes cannot quantise meta weights, so the quantised
    Linears are swapped for stand-ins here. Their unquantised neighbours keep the dtype the pilot gives them
    (``models.loading._prepare_quantized``): fp32 (peft's prepare_model_for_kbit_training upcasts them), the
    compute dtype under ``prepare: none``, bf16 under bf16-true(-autocast)."""
    from ..models.adapters import is_adapter_parameter

    out = Adaptation()
    named = {id(p): (n, p) for n, p in model.named_parameters()}.values()
    adapter = [p for n, p in named if is_adapter_parameter(n)]
    out.base_parameters = sum(p.numel() for n, p in named if not is_adapter_parameter(n))
    quant = spec.model.quantization
    base_dtype = torch.bfloat16 if spec.train.precision in BF16_WEIGHTS else torch.float32
    if quant is not None:
        base_dtype = _prepared(model, spec, base_dtype, out)
    if spec.model.adapter is not None:
        out.adapter_parameters = sum(p.numel() for p in adapter)
        out.adapter_bytes = sum(p.numel() * p.element_size() for p in adapter)
        out.adapted_layers = sum(1 for n, _ in named if ".lora_A." in n)
        out.notes.append(f"LoRA r={spec.model.adapter.r} on {out.adapted_layers} Linear layers: "
                         f"{out.adapter_parameters:,} trainable parameters; the base is frozen (no gradients, "
                         "no optimizer state)")
    if quant is not None:
        _quantize(model, spec, base_dtype, out)
        out.notes.append(f"{quant.bits}-bit base: {out.quantized_layers} Linear layers held as bitsandbytes "
                         "stores them (packed weights + quantisation state), each dequantised only while in flight")
    out.trainable_parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
                                   if p.requires_grad)
    if spec.export.merge and quant is None:
        # The export gate merges into the base as trained (models.adapters.merged_copy): the base's dtype.
        out.merged_bytes = out.base_parameters * torch.empty((), dtype=base_dtype).element_size()
    elif spec.export.merge:
        out.notes.append("export.merge: the export gate does not merge into a quantised base (it would round the "
                         "adapter into 4/8-bit weights); no merged model is counted")
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
    """The optimizer the trace steps, and how it runs on ``target`` (for the notes): the pilot's own choice
    (``train.optim.build_optimizer_choice``: fused AdamW where the target has the kernel), except bitsandbytes'
    8-bit AdamW, whose kernels do not run on fake tensors (a stand-in with its state, above)."""
    from ..train.optim import build_optimizer_choice, param_groups

    o = spec.train.optimizer
    if o.name in ("adamw8bit", "paged_adamw8bit"):
        groups = param_groups(model, o.weight_decay)
        return StateSizedOptimizer([g for g in groups if g["params"]], o.name, o.lr), (
            f"{o.name}: bitsandbytes' state sizes (estimate/layouts.py), fused in-place update")
    opt, choice = build_optimizer_choice(model, o, torch.device(target))
    if o.name == "adamw" and choice.fused:
        return opt, f"adamw fused (no step temporaries): {choice.reason}"
    if o.name in ("adamw", "sgd"):
        for group in opt.param_groups:
            group["foreach"] = target != "cpu"  # CUDA's default multi-tensor path, with its temporaries
        return opt, f"{o.name} {'foreach' if target != 'cpu' else 'per-parameter'} path ({choice.reason})"
    return opt, choice.reason
