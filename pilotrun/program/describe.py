"""The job a program runs, read from its own objects: what ``estimate``, ``select`` and ``plan`` trace for a program.

The integrations call :func:`describe_objects` at train begin with the framework's objects (the model, the optimizer
it built, its batch and precision settings); a bare script calls ``job.describe(...)`` with the same keywords. The
result is a :class:`JobFacts`: only what the program's objects say, each field None where they do not say it (the
estimate then names what it assumed). Nothing here imports what a model names: a transformers model is described by
its config mapping, a plain module by its class name only.

Example::

    facts = describe_objects(model, optimizer, micro_batch_size=4, grad_accum_steps=2, precision="bf16",
                             max_length=2048, updates=1000)
    facts.to_dict()["optimizer"]   # {"class": "torch.optim.adamw.AdamW", "name": "adamw", "lr": 0.001, ...}
"""
from __future__ import annotations

import itertools
import json
import math
import types
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import torch

from ..config.sections import Precision
from ..ledger.records import TextEnum
from ..models.structure import repeated_blocks
from ..train.compile import compiled_scope

# Examples read to find the longest the collate produces: enough for a fine-tuning set's long tail, bounded for a
# streamed one (the describe run stops right after, so reading them changes nothing the run does).
LENGTH_SCAN = 20_000

# Config keys that say where a model came from or how it was loaded, not what it is: the estimate rebuilds the
# architecture and sets its own precision (train.precision), so a saved dtype must not leak into the trace.
NOT_ARCHITECTURE = ("transformers_version", "_name_or_path", "architectures", "quantization_config", "dtype",
                    "torch_dtype", "_commit_hash", "_attn_implementation_autoset", "auto_map")

# An optimizer class's module-qualified name -> the estimator's train.optimizer.name for it.
OPTIMIZERS = {
    "torch.optim.adamw.AdamW": "adamw",
    "torch.optim.adam.Adam": "adamw",        # the same state (two moments) and step traffic as AdamW
    "torch.optim.sgd.SGD": "sgd",
    "bitsandbytes.optim.adamw.AdamW8bit": "adamw8bit",
    "bitsandbytes.optim.adam.Adam8bit": "adamw8bit",
    "bitsandbytes.optim.adamw.PagedAdamW8bit": "paged_adamw8bit",
    "bitsandbytes.optim.adam.PagedAdam8bit": "paged_adamw8bit",
    "transformers.optimization.Adafactor": "adafactor",
}

# Lightning's Trainer.precision and Fabric's precision setting -> train.precision ("16-true" has no pilotrun
# equivalent: pure fp16 weights). "bf16-mixed" over bf16 parameters is bf16-true-autocast (describe_objects).
LIGHTNING_PRECISION: dict[str, Precision] = {
    "32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-true": "bf16-true"}


@dataclass
class JobFacts:
    """What the program's objects say about its job; None where they say nothing."""

    framework: str                              # who described it: transformers.Trainer, lightning, job.describe
    model_kind: str                             # "transformers" (rebuildable from config) or "module" (class only)
    model_class: str                            # module-qualified class of the model (the base under an adapter)
    parameters: int
    trainable_parameters: int
    parameter_dtype: str                        # the most common dtype of the parameters (float32, bfloat16, ...)
    config: dict | None = None                  # the transformers config mapping (model_kind transformers)
    head: str | None = None                     # models.loading.HF_HEADS' keys | None (another head)
    adapter: dict | None = None                 # {type, r, alpha, dropout, target_modules} of a PEFT LoRA
    quantization: dict | None = None            # {bits, type, double_quant, compute_dtype, prepare} of a bnb base
    optimizer: dict | None = None               # {class, name (None: not one the estimator traces), lr, ...}
    precision: str | None = None                # as train.precision names it
    precision_source: str = ""
    activation_checkpointing: bool | None = None
    checkpointing_policy: str | None = None     # full, selective, selective-N, every-N (checkpointing_policy())
    checkpointing_source: str = ""
    compile: str | None = None                  # train.compile's words (model, blocks) | None: eager as far as seen
    compile_source: str = ""                    # how it was seen (a compiled module, the framework's setting)
    attn_implementation: str | None = None      # the transformers model's attention (sdpa, flash_attention_2, ...)
    micro_batch_size: int | None = None
    grad_accum_steps: int | None = None
    world_size: int = 1
    updates: int | None = None                  # the optimizer updates the program will run
    max_grad_norm: float | None = None
    max_length: int | None = None
    length_source: str = ""                     # declared, or how it was measured
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self), default=str))

    @classmethod
    def from_dict(cls, data: dict) -> JobFacts:
        """From an event's mapping or a cache entry; ValueError naming the field when it is not one, or when a value
        is not what :func:`describe_objects` writes there (a hand-edited or damaged cache entry must be described
        again, never reach the estimate as a string where a count belongs)."""
        if not isinstance(data, dict):
            raise ValueError("the description is not a mapping")
        known = set(cls.__dataclass_fields__)
        kept = {k: v for k, v in data.items() if k in known}
        hints = get_type_hints(cls)
        for key, value in kept.items():
            if not _is_a(value, hints[key]):
                raise ValueError(f"field {key!r} is {type(value).__name__} {str(value)[:40]!r}, not {hints[key]}")
        if (why := _values_problem(kept)) is not None:
            raise ValueError(why)
        try:
            return cls(**kept)
        except TypeError as exc:
            raise ValueError(f"the description lacks a field: {exc}") from None


def _is_a(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of a JobFacts field's type (an int is no bool; a float may be written as an int)."""
    if isinstance(hint, types.UnionType):
        return any(_is_a(value, h) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if get_origin(hint) is list:
        return isinstance(value, list) and all(_is_a(v, get_args(hint)[0]) for v in value)
    if get_origin(hint) is dict or hint is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _values_problem(facts: dict) -> str | None:
    """What the estimate reads inside the mappings and counts, when it is not as describe_objects writes it."""
    for key in ("micro_batch_size", "grad_accum_steps", "world_size", "parameters", "trainable_parameters",
                "updates", "max_length"):
        least = 0 if key in ("parameters", "trainable_parameters", "updates", "max_length") else 1
        if isinstance(facts.get(key), int) and facts[key] < least:
            return f"field {key!r} is {facts[key]}, below {least}"
    opt = facts.get("optimizer")
    if opt is not None:
        if not isinstance(opt.get("class"), str) or not isinstance(opt.get("name"), (str, type(None))):
            return "field 'optimizer' has no 'class' string or a 'name' that is not a string"
        if any(k in opt and not _number(opt[k]) for k in ("lr", "weight_decay", "eps", "momentum")) or (
                "betas" in opt and not (isinstance(opt["betas"], list) and len(opt["betas"]) == 2
                                        and all(_number(b) for b in opt["betas"]))):
            return "field 'optimizer' holds a hyper-parameter that is not a number"
    quant = facts.get("quantization")
    if quant is not None and not (isinstance(quant.get("bits"), int) or isinstance(quant.get("unsupported"), str)):
        return "field 'quantization' has neither 'bits' nor 'unsupported'"
    if facts.get("compile") not in (None, "model", "blocks"):
        return f"field 'compile' is {facts['compile']!r}, not model, blocks or null"
    labels = (facts.get("config") or {}).get("id2label")
    if labels is not None and not (isinstance(labels, dict) and all(str(k).isdigit() for k in labels)):
        return "field 'config' has an id2label whose keys are not class indices"
    return None


def _qualname(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module the program's wrappers hold: DDP/FSDP1 ``.module``, ``torch.compile``'s ``_orig_mod``."""
    for _ in range(8):
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            model = inner
            continue
        if type(model).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel", "DataParallel"):
            model = model.module  # type: ignore[assignment]
            continue
        break
    return model


def compile_seen(model: torch.nn.Module) -> str | None:
    """How the program compiled its model (``train.compile``'s words), looking through the wrappers
    :func:`unwrap_model` strips: a ``torch.compile`` wrapper or a module compiled in place, whole or per block."""
    for _ in range(8):
        if (scope := compiled_scope(model, repeated_blocks(model)[1])) is not None:
            return scope
        if isinstance(getattr(model, "_compiler_ctx", None), dict):  # Lightning's mark on a compiled LightningModule
            return "model"
        # torch.compile's wrapper, DDP/FSDP1, Fabric's _FabricModule (what runs is its _forward_module)
        inner = next((m for a in ("_orig_mod", "_forward_module", "module")
                      if isinstance(m := getattr(model, a, None), torch.nn.Module)), None)
        if inner is None:
            return None
        model = inner
    return None


def accelerator_compile(accelerator: Any) -> tuple[str | None, str]:
    """What accelerate's ``dynamo_plugin`` (``Accelerator(dynamo_backend=...)``; the Trainer's ``torch_compile``
    sets it too) compiles at ``prepare``: ``(scope, source)``, ``(None, "")`` without one. Read by attribute, never
    imported: regional compilation is accelerate's per-block compile."""
    plugin = getattr(getattr(accelerator, "state", None), "dynamo_plugin", None)
    backend = getattr(plugin, "backend", None)
    name = str(getattr(backend, "value", backend) or "no")
    if name.lower() == "no":
        return None, ""
    regional = bool(getattr(plugin, "use_regional_compilation", False))
    return ("blocks" if regional else "model",
            f"accelerate's dynamo_plugin (backend {name}{', regional compilation' if regional else ''})")


def unwrap_optimizer(opt: Any) -> Any:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` and Lightning's ``LightningOptimizer``."""
    for _ in range(4):
        inner = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
        if inner is None or inner is opt or not hasattr(inner, "param_groups"):
            break
        opt = inner
    return opt


def _is_transformers(module: Any) -> bool:
    config = getattr(module, "config", None)
    return isinstance(module, torch.nn.Module) and hasattr(config, "to_dict") and bool(getattr(config, "model_type",
                                                                                               ""))


def _transformers_inside(model: torch.nn.Module) -> torch.nn.Module | None:
    """The transformers model a wrapper (a LightningModule, a plain module holding ``self.model``) trains, when every
    parameter of the wrapper is that model's."""
    if _is_transformers(model):
        return model
    total = sum(p.numel() for p in model.parameters())
    for _name, sub in model.named_modules():
        if sub is not model and _is_transformers(sub) and sum(p.numel() for p in sub.parameters()) == total:
            return sub
    return None


def _head(model: torch.nn.Module) -> str | None:
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal-lm"
    if name.endswith("ForSequenceClassification"):
        return "seq-classification"
    if name.endswith("ForTokenClassification"):
        return "token-classification"
    # An encoder-decoder's generation head (T5, BART); a decoder-only "ForConditionalGeneration" (a vision-language
    # model) is not one.
    if name.endswith(("ForConditionalGeneration", "ForSeq2SeqLM")) and getattr(model.config, "is_encoder_decoder",
                                                                                   False):
        return "seq2seq-lm"
    return None


def _architecture(config: Any) -> dict:
    data = json.loads(json.dumps(config.to_dict(), default=str))
    return {k: v for k, v in data.items() if k not in NOT_ARCHITECTURE}


def _adapter(model: torch.nn.Module) -> tuple[torch.nn.Module, dict | None]:
    """The base under a PEFT model, and its LoRA adapter as model.adapter says it."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not hasattr(model, "get_base_model"):
        return model, None
    name = getattr(model, "active_adapter", None)
    cfg = configs.get(name if isinstance(name, str) else "default") or next(iter(configs.values()), None)
    base = model.get_base_model()  # type: ignore[operator]
    if cfg is None or str(getattr(cfg, "peft_type", "")).split(".")[-1].upper() != "LORA":
        return base, {"type": str(getattr(cfg, "peft_type", "unknown")), "unsupported": True}
    targets = cfg.target_modules
    if isinstance(targets, (set, list, tuple)):
        # PEFT matches a name by its last component(s); the injected set holds full paths.
        targets = sorted({str(t).split(".")[-1] for t in targets})
    return base, {"type": "lora", "r": int(cfg.r), "alpha": float(cfg.lora_alpha), "dropout": float(cfg.lora_dropout),
                  "target_modules": targets}


def _quantization(config: Any) -> dict | None:
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    get = (lambda k: q.get(k)) if isinstance(q, dict) else (lambda k: getattr(q, k, None))
    if get("load_in_4bit"):
        dtype = str(get("bnb_4bit_compute_dtype") or "float32").replace("torch.", "")
        return {"bits": 4, "type": get("bnb_4bit_quant_type") or "nf4",
                "double_quant": bool(get("bnb_4bit_use_double_quant")),
                "compute_dtype": {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "fp32")}
    if get("load_in_8bit"):
        return {"bits": 8}
    return {"unsupported": str(get("quant_method") or type(q).__name__)}


def _weights_precision(dtype: str, precision: str | None, source: str) -> tuple[str | None, str]:
    """train.precision for bf16 parameters: no fp32 master copy, bf16 gradients and optimizer state (train.precision:
    bf16 would trace fp32 weights and overstate memory). With the framework's bf16 autocast over them (the Trainer's
    bf16=True, accelerate's mixed_precision='bf16', Lightning's 'bf16-mixed') bf16-true-autocast, else bf16-true."""
    if dtype != "bfloat16" or precision not in (None, "bf16"):
        return precision, source
    if precision == "bf16":
        return "bf16-true-autocast", f"the parameters are bfloat16 and {source or 'precision=bf16'} autocasts over them"
    return "bf16-true", "the parameters are bfloat16 and no autocast was declared"


def kbit_preparation(model: torch.nn.Module, quantization: dict) -> tuple[str, str]:
    """Whether peft's ``prepare_model_for_kbit_training`` ran on a quantised model, as ``model.quantization.prepare``
    says it, and how that was read: it upcasts every fp16/bf16 parameter bitsandbytes did not quantise (embeddings,
    norms, output head) to fp32, so one left in fp16/bf16 means it did not run. With all of them in fp32 the
    preparation's memory is what the program holds (whether peft or an fp32 load put them there). An 8-bit base has
    no compute dtype of its own: one not prepared gets the dtype its parameters hold as ``compute_dtype`` (what
    ``prepare: none`` holds them in)."""
    from ..models.adapters import is_adapter_parameter

    dtypes = sorted({str(p.dtype).replace("torch.", "") for n, p in model.named_parameters()
                     if p.is_floating_point() and not is_adapter_parameter(n)})
    low = [d for d in dtypes if d in ("bfloat16", "float16")]
    if not low:
        if not dtypes:
            return "peft", "the base has no unquantised floating parameter: nothing to prepare (peft assumed)"
        return "peft", (f"the base's unquantised parameters (norms, embeddings, head) are {', '.join(dtypes)}, as "
                        "prepare_model_for_kbit_training leaves them")
    names = {"bfloat16": "bf16", "float16": "fp16"}
    if quantization.get("bits") == 8:
        quantization["compute_dtype"] = names[low[0]]
    held = quantization.get("compute_dtype", "bf16")
    return "none", (f"the base's unquantised parameters are {', '.join(dtypes)}: prepare_model_for_kbit_training "
                    f"did not run (it upcasts them to float32); traced in {held}")


def checkpointing_policy(model: torch.nn.Module) -> tuple[str | None, str]:
    """The policy a transformers model's activation checkpointing runs, as ``train.activation_checkpointing`` names
    it, and how it was read: ``every-N`` from which blocks checkpoint, ``selective``/``selective-N`` by asking the
    selective policy function (a ``context_fn`` in the checkpoint arguments) what it keeps of a run of matmuls, else
    ``full``. None when no block checkpoints."""
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    from ..models.loading import checkpoint_blocks

    # transformers 4 before GradientCheckpointingLayer: every module with the switch
    blocks = checkpoint_blocks(model) or [m for m in model.modules()
                                          if hasattr(m, "gradient_checkpointing") and m is not model]
    on = [bool(getattr(m, "gradient_checkpointing", False)) for m in blocks]
    if not any(on):
        return None, "no block checkpoints"
    if not all(on):
        every = len(on) // max(sum(on), 1)
        if every >= 2 and on == [i % every == 0 for i in range(len(on))]:
            return f"every-{every}", f"{sum(on)} of {len(on)} blocks checkpoint"
    func = next((getattr(m, "_gradient_checkpointing_func", None) for m in blocks), None)
    context_fn = getattr(func, "keywords", {}).get("context_fn")
    if context_fn is None:
        return "full", "checkpoint without a selective policy"
    try:
        mode = context_fn()[0]
        policy = mode.policy_fn
        saved = [policy(SelectiveCheckpointContext(is_recompute=False), torch.ops.aten.mm.default) in
                 (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True) for _ in range(8)]
    except Exception as exc:   # a policy that needs real arguments: said, and traced as full
        return "full", f"a selective policy that could not be asked ({type(exc).__name__}): traced as full"
    stride = next((n for n in range(1, 9) if saved == [i % n == 0 for i in range(8)]), None)
    if stride is None:
        return "full", f"a selective policy that keeps matmuls {saved}: not one pilotrun names, traced as full"
    return ("selective" if stride == 1 else f"selective-{stride}"), f"its selective policy keeps 1 matmul in {stride}"


def _checkpointing(model: torch.nn.Module) -> bool | None:
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers 5 deprecates one of the two names
            value = getattr(model, attr, None)
        if isinstance(value, bool):
            return value
    return None


def describe_optimizer(opt: Any) -> dict | None:
    """The optimizer's class, the estimator's name for it (None: not one it traces) and its hyper-parameters."""
    if opt is None:
        return None
    opt = unwrap_optimizer(opt)
    qual = _qualname(opt)
    groups = getattr(opt, "param_groups", None) or [{}]
    first = {**getattr(opt, "defaults", {}), **groups[0]}
    out: dict[str, Any] = {"class": qual, "name": OPTIMIZERS.get(qual)}
    for key in ("lr", "weight_decay", "eps", "momentum"):
        # A scheduler's warm-up has already lowered lr at train begin (to 0 at its first step); the peak it
        # started from is initial_lr.
        value = first.get("initial_lr", first.get(key)) if key == "lr" else first.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = float(value)
    betas = first.get("betas")
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        out["betas"] = [float(b) for b in betas]
    out["fused"] = bool(first.get("fused")) if out["name"] == "adamw" else None
    return out


def dominant_dtype(model: torch.nn.Module) -> str:
    counts: dict[str, int] = {}
    for p in model.parameters():
        key = str(p.dtype).replace("torch.", "")
        counts[key] = counts.get(key, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else "float32"


def batch_length(batch: Any) -> int | None:
    """The sequence length of a collated batch: its ``input_ids``' second dimension."""
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    if isinstance(ids, torch.Tensor) and ids.ndim >= 2:
        return int(ids.shape[1])
    return None


def longest_collated(dataset: Any, collate: Any, micro_batch: int, scan: int = LENGTH_SCAN) -> tuple[int | None, str]:
    """The length the collate gives the longest micro batch among the first ``scan`` examples, and how it was found."""
    from ..train.batches import item_length

    try:
        sized = len(dataset)
    except TypeError:
        sized = None
    try:
        items = ([dataset[i] for i in range(min(sized, scan))] if sized is not None
                 else list(itertools.islice(iter(dataset), scan)))
        lengths = sorted(((item_length(item, collate), i) for i, item in enumerate(items)), reverse=True)
        longest = [items[i] for _, i in lengths[:max(1, micro_batch)]]
        found = batch_length(collate(longest)) if longest else None
    except Exception as exc:  # the program's own dataset or collate: say why, the estimate asks for max_length
        return None, f"not measured: reading the training examples failed ({type(exc).__name__}: {exc})"
    if found is None:
        return None, "not measured: the collated batch has no input_ids"
    read = len(items)
    of = f"all {read}" if sized is not None and read == sized else f"the first {read}" + (
        f" of {sized}" if sized is not None else "")
    return found, f"the longest micro batch the program's collate produces from {of} training examples"


def describe_objects(model: torch.nn.Module, optimizer: Any = None, *, framework: str = "job.describe",
                     micro_batch_size: int | None = None, grad_accum_steps: int | None = None,
                     precision: str | None = None, precision_source: str = "", activation_checkpointing: bool | None
                     = None, max_length: int | None = None, length_source: str = "", batch: Any = None,
                     world_size: int = 1, updates: int | None = None, max_grad_norm: float | None = None,
                     compile: str | None = None, compile_source: str = "") -> JobFacts:
    """The facts of a job from its objects. ``batch`` (a collated micro batch) gives the micro batch size and the
    length when they are not given; ``compile`` (model or blocks) says the model runs compiled when the model
    object does not show it yet (a framework that compiles later)."""
    notes: list[str] = []
    seen = compile_seen(model)
    model = unwrap_model(model)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dtype = dominant_dtype(model)
    base, adapter = _adapter(model)
    hf = _transformers_inside(base)
    facts = JobFacts(framework=framework, model_kind="transformers" if hf is not None else "module",
                     model_class=_qualname(hf if hf is not None else base), parameters=total,
                     trainable_parameters=trainable, parameter_dtype=dtype, adapter=adapter,
                     optimizer=describe_optimizer(optimizer), world_size=int(world_size), updates=updates,
                     max_grad_norm=max_grad_norm, notes=notes)
    if hf is not None:
        facts.config = _architecture(hf.config)
        facts.head = _head(hf)
        facts.quantization = _quantization(hf.config)
        if facts.quantization is not None and "bits" in facts.quantization:
            facts.quantization["prepare"], how = kbit_preparation(hf, facts.quantization)
            notes.append(f"model.quantization.prepare: {facts.quantization['prepare']}, {how}")
        if activation_checkpointing is None:
            activation_checkpointing = _checkpointing(hf)
        if activation_checkpointing:
            facts.checkpointing_policy, facts.checkpointing_source = checkpointing_policy(hf)
        impl = getattr(hf.config, "_attn_implementation", None)
        facts.attn_implementation = impl if isinstance(impl, str) else None
    facts.activation_checkpointing = activation_checkpointing
    facts.compile = seen or compile
    facts.compile_source = compile_source or ("declared" if compile and not seen else "") or (
        ("the model runs torch.compile'd" + (" per block" if seen == "blocks" else "")) if seen else "")
    precision, precision_source = _weights_precision(dtype, precision, precision_source)
    facts.precision, facts.precision_source = precision, precision_source if precision else ""
    if batch is not None:
        ids = batch.get("input_ids") if hasattr(batch, "get") else None
        if micro_batch_size is None and isinstance(ids, torch.Tensor):
            micro_batch_size = int(ids.shape[0])
        if max_length is None and (found := batch_length(batch)) is not None:
            max_length, length_source = found, "the length of the batch given to job.describe"
    facts.micro_batch_size = micro_batch_size
    facts.grad_accum_steps = grad_accum_steps
    facts.max_length = max_length
    facts.length_source = length_source or ("declared" if max_length is not None else "")
    return facts


# ------------------------------------------------------------------------------ the framework a program's loop uses


class Framework(TextEnum):
    """A framework with a pilotrun integration, as a program's own files use it."""

    TRANSFORMERS = "transformers Trainer"
    LIGHTNING = "Lightning Trainer"
    FABRIC = "Lightning Fabric"
    ACCELERATE = "accelerate"


# What a program of each framework adds for the gates that need its model and batches (README, "The Trainer and
# Lightning callbacks"), and the integration module that does it.
INTEGRATIONS: dict[Framework, tuple[str, str]] = {
    Framework.TRANSFORMERS: ("transformers", "callbacks=[PilotrunCallback()] on the Trainer (from "
                                             "pilotrun.integrations.transformers)"),
    Framework.LIGHTNING: ("lightning", "callbacks=[PilotrunCallback()] on the Trainer (from "
                                       "pilotrun.integrations.lightning)"),
    Framework.FABRIC: ("fabric", "pilotrun.integrations.fabric.begin(job, fabric, model, optimizer, loader, "
                                 "loss=...) after fabric.setup and fabric.setup_dataloaders"),
    Framework.ACCELERATE: ("accelerate", "pilotrun.integrations.accelerate.begin(job, accelerator, model, optimizer, "
                                         "loader, loss=...) after accelerator.prepare"),
}
SOURCE_CAP = 4 << 20  # bytes of one program file read for its imports: far above any training script


def _imports_and_names(tree: Any) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """(every dotted module imported and its parents, the names imported from each top package, every name and
    attribute the code uses)."""
    import ast

    modules: set[str] = set()
    imported: dict[str, set[str]] = {}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                modules.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            modules.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            modules.update(f"{node.module}.{a.name}" for a in node.names)
            imported.setdefault(parts[0], set()).update(a.name for a in node.names)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return modules, imported, names


def _read_program(files: list[Path]) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """:func:`_imports_and_names` over the program's ``.py`` files; a file that cannot be read or parsed adds none."""
    import ast

    from ..safefile import FileProblem, read_bytes

    modules: set[str] = set()
    imported: dict[str, set[str]] = {}
    names: set[str] = set()
    for path in files:
        if path.suffix != ".py":
            continue
        try:
            found = _imports_and_names(ast.parse(read_bytes(path, SOURCE_CAP)))
        except (FileProblem, SyntaxError, ValueError):
            continue
        modules |= found[0]
        for top, got in found[1].items():
            imported.setdefault(top, set()).update(got)
        names |= found[2]
    return modules, imported, names


def program_frameworks(files: list[Path]) -> list[Framework]:
    """The frameworks whose loop the program's own ``.py`` files use, read with ``ast`` (never run): Fabric (imports
    ``lightning.fabric``, or ``lightning`` and uses ``Fabric``), the Lightning Trainer (``lightning.pytorch``,
    ``pytorch_lightning``, or ``lightning`` and its ``Trainer``), a transformers/TRL ``*Trainer``, accelerate's
    ``Accelerator``."""
    modules, imported, names = _read_program(files)
    lightning = "lightning" in modules
    hf_trainers = {n for top in ("transformers", "trl") for n in imported.get(top, ()) if n.endswith("Trainer")}
    uses = {
        Framework.FABRIC: "lightning.fabric" in modules or "lightning_fabric" in modules
        or (lightning and "Fabric" in names),
        Framework.LIGHTNING: "lightning.pytorch" in modules or "pytorch_lightning" in modules
        or (lightning and bool({"Trainer", "LightningModule"} & names - hf_trainers)),
        Framework.TRANSFORMERS: bool(hf_trainers),
        Framework.ACCELERATE: "accelerate" in modules and "Accelerator" in names,
    }
    return [f for f in Framework if uses[f]]


def integration_needed(files: list[Path]) -> str | None:
    """What a gate that needs the model and batches inside the program says on a program that recorded none of its
    rows, naming the integration that fits the framework its files use; None when they use none of them."""
    frameworks = program_frameworks(files)
    if not frameworks:
        return None
    modules = _read_program(files)[0]
    said = []
    for framework in frameworks:
        module, lines = INTEGRATIONS[framework]
        if f"pilotrun.integrations.{module}" in modules:  # the program has it: it did not reach the probes
            said.append(f"the program imports pilotrun.integrations.{module} ({framework}) but recorded no row of "
                        f"this gate: {lines}, reached on rank 0 before the first update, records it")
        else:
            said.append(f"the program uses {framework}: add {lines}")
    return ("needs the model and batches inside the program, which only an integration records; "
            + "; ".join(said))
