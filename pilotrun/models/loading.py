"""Building the model and tokenizer a spec names: a factory, a Hugging Face folder or Hub id, or a config.

Nothing here downloads on its own initiative: a Hub id is passed to transformers,
which uses its cache and honours ``HF_HUB_OFFLINE``; a failure says how to fix it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config.factories import factory_guard, import_factory
from ..config.hub_cache import TokenizerNotFound
from ..config.paths import resolve_path
from ..config.sections import BF16_WEIGHTS, ModelSpec, Precision, QuantizationSpec, ac_policy, ac_words, matmul_stride
from ..config.spec import BuildContext


class ModelError(Exception):
    """The model or tokenizer cannot be built as specified; the message says why and what to change. ``field`` is
    the spec key at fault when one is (the pre-flight check turns such an error into exit 2)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class LoadedModel:
    model: torch.nn.Module
    kind: str  # hf or factory
    head: str  # causal-lm, seq-classification or custom
    source: str
    notes: list[str] = field(default_factory=list)
    config: Any = None  # the transformers config (or the factory model's .config), when there is one
    # With model.adapter: the frozen base's sha256 as built (models.adapters.base_identity), which a checkpoint of
    # the adapter alone records and a restore compares. None without an adapter.
    base_identity: str | None = None
    quantized: bool = False  # the base was loaded through bitsandbytes (it cannot be cast or moved by .to())
    # Activation checkpointing was asked for by the caller (the estimator's variant) and this model has no switch for
    # it: the note saying so, which the estimator repeats in its own notes; None otherwise.
    checkpointing_unavailable: str | None = None


def _hub_hint(exc: Exception, target: str) -> str:
    return (
        f"could not load {target!r}: {type(exc).__name__}: {exc}. If this is a Hub id, this machine may have no "
        "network: download it elsewhere and point model.hf at the local folder"
    )


def local_path(target: str, folder: Path) -> Path | None:
    """The local file or folder a model/tokenizer value names (relative to ``folder``, the spec's), or None for a
    Hub id."""
    try:
        p = resolve_path(target, folder)
    except FileNotFoundError:
        return None
    return p if p.exists() else None


def load_tokenizer(model: ModelSpec, folder: Path):
    """The tokenizer for built-in tasks (None for factory data that brings its own), from the spec's ``model``
    section; local paths are relative to ``folder`` (the spec's).

    ``model.tokenizer`` is a local path or a Hub id found in the local cache (never downloaded); without it the
    tokenizer of ``model.hf`` is loaded the way the model is."""
    target = model.tokenizer or model.hf
    if target is None:
        return None
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    local = local_path(target, folder)
    if model.tokenizer is not None:
        try:
            local = model.tokenizer_source(folder).path
        except TokenizerNotFound as exc:
            raise ModelError(f"model.tokenizer: {exc}") from None
    tok: Any
    try:
        if local is not None and local.is_file():
            tok = PreTrainedTokenizerFast(tokenizer_file=str(local))
        elif local is not None:
            tok = AutoTokenizer.from_pretrained(str(local), trust_remote_code=model.trust_remote_code)
        else:
            tok = AutoTokenizer.from_pretrained(target, revision=model.revision,
                                                trust_remote_code=model.trust_remote_code)
    except Exception as exc:
        raise ModelError(_hub_hint(exc, target)) from None
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


# The transformers Auto class of each head data.task names (a described program's head among them): the trace
# builds the program's own kind of model, not a causal LM with its config.
HF_HEADS = {"causal-lm": "AutoModelForCausalLM", "seq-classification": "AutoModelForSequenceClassification",
            "token-classification": "AutoModelForTokenClassification", "seq2seq-lm": "AutoModelForSeq2SeqLM"}
# Heads whose config carries class names (num_labels, id2label): the data's labels size the head.
LABELLED_HEADS = ("seq-classification", "token-classification")


def _hf_classes(head: str):
    import transformers

    return getattr(transformers, HF_HEADS.get(head, HF_HEADS["causal-lm"]))


def head_for(task: str | None, label_names: list[str] | None) -> tuple[str, str]:
    """The model head the data implies (``data.task``, else the factory's label_names), and why."""
    if task is not None:
        return task, f"data.task is {task}"
    if label_names:
        return "seq-classification", "the data factory returned label_names, so a sequence-classification head"
    return "causal-lm", "the data factory returned no label_names, so a causal-LM head"


def build_model(model: ModelSpec, job: BuildContext, label_names: list[str] | None = None, tokenizer=None, *,
                meta: bool = False, activation_checkpointing: bool | str | None = None,
                device: torch.device | str = "cpu") -> LoadedModel:
    """The one model builder: random init (seeded) or loaded weights, for the pilot, every worker and the estimator.
    It reads the spec's ``model`` section and, from ``job`` (``spec.build_context()``), the folder relative paths
    and factories start from, the seed, ``train.precision``, ``train.activation_checkpointing`` and ``data.task``.

    In order: the base (a factory, a config or a Hub/local folder), quantised through bitsandbytes when
    ``model.quantization`` says so (placed on ``device`` as it loads: a quantised model is not moved afterwards),
    prepared as ``model.quantization.prepare`` says, cast to bf16 for ``train.precision: bf16-true`` and
    ``bf16-true-autocast``, activation checkpointing, then the LoRA adapter of ``model.adapter`` (peft; the base
    frozen). ``meta=True`` builds shapes only on the meta device — no weights
    read, no memory (the estimator's trace); a Hub or local model then needs only its config, and a quantised base
    is left unquantised (bitsandbytes quantises real weights only; a note says so). ``activation_checkpointing``
    overrides the spec's setting (the estimator traces both); a model without the switch fails the build when
    the spec asks for it, and only gets a note when the estimator asked. Raises :class:`ModelError`
    (with ``field`` set for an adapter the model cannot take) or
    :class:`pilotrun.models.quantize.KernelUnavailable` (an operation this device lacks).
    """
    from .adapters import AdapterError, apply_adapter, base_identity
    from .quantize import Kernel, require_kernels

    quant = model.quantization if not meta else None
    if quant is not None:
        require_kernels([Kernel.MATMUL_4BIT if quant.bits == 4 else Kernel.MATMUL_8BIT], torch.device(device).type)
    torch.manual_seed(job.seed)
    loaded = (_build_factory(model, job, meta) if model.factory is not None
              else _build_hf(model, job, label_names, tokenizer, meta, device=device))
    if meta and model.quantization is not None:
        loaded.notes.append("model.quantization not applied on the meta device (bitsandbytes quantises real weights)")
    if quant is not None:
        from .quantize import keep_training_path

        if keep_training_path(loaded.model):
            loaded.notes.append("bitsandbytes' CPU eval-time repacking of 4-bit weights turned off: after it, training "
                                "forwards run gemv_4bit, which has no autograd kernel (wrong gradients)")
        _prepare_quantized(loaded, quant, job.precision)
    if job.precision in BF16_WEIGHTS:
        _cast_bf16(loaded.model)
        loaded.notes.append(f"{job.precision}: floating-point parameters held in bf16, "
                            + ("no autocast" if job.precision == "bf16-true" else "bf16 autocast over them"))
    ac = job.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    if policy := ac_policy(ac):
        try:
            enabled = enable_activation_checkpointing(loaded.model, policy)
        except ModelError as exc:
            if activation_checkpointing is None:  # the spec asked for the policy: its error names the fix
                raise
            enabled = False  # the estimator or the advisor asked: it says so and traces without it
            loaded.checkpointing_unavailable = str(exc).removeprefix("train.activation_checkpointing: ")
            loaded.notes.append(loaded.checkpointing_unavailable)
        if enabled:
            loaded.notes.append(f"{ac_words(policy)} on (non-reentrant)")
        elif not loaded.checkpointing_unavailable:
            if activation_checkpointing is None:
                raise ModelError(
                    "train.activation_checkpointing is true but the model has no gradient_checkpointing_enable(); "
                    "wrap its blocks with torch.utils.checkpoint in the factory, or set it to false",
                    field="train.activation_checkpointing")
            loaded.checkpointing_unavailable = ("activation checkpointing requested but the model has no "
                                                "gradient_checkpointing_enable()")
            loaded.notes.append(loaded.checkpointing_unavailable)
    adapter = model.adapter
    if adapter is not None:
        try:
            loaded.model = apply_adapter(loaded.model, adapter, loaded.head, keep_dtype=job.precision == "bf16-true")
        except AdapterError as exc:
            raise ModelError(f"{exc.field}: {exc}", field=exc.field) from None
        if job.precision == "bf16-true":
            _cast_bf16(loaded.model)  # peft creates LoRA matrices in fp32 on a non-float (quantised) base
        loaded.notes.append(f"LoRA adapter (peft): r={adapter.r}, alpha={adapter.alpha:g}, dropout={adapter.dropout:g},"
                            f" target_modules={adapter.target_modules}; the base is frozen")
        if not meta:
            loaded.base_identity = base_identity(loaded.model)
    return loaded


def _cast_bf16(model: torch.nn.Module) -> None:
    """Floating-point parameters to bf16 in place (tied weights stay tied: one Parameter object). Buffers keep their
    dtype, as ``from_pretrained(torch_dtype=torch.bfloat16)`` keeps rotary frequencies in fp32; quantised weights
    (uint8/int8) are not floating point and stay as they are."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.bfloat16:
            p.data = p.data.to(torch.bfloat16)


def _prepare_quantized(loaded: LoadedModel, q: QuantizationSpec, precision: Precision) -> None:
    """The QLoRA preparation ``model.quantization.prepare`` names: peft's (the base frozen, its fp16/bf16
    non-quantised weights upcast to fp32 for stable norms) or none (those weights held in the compute dtype, as a
    program that loads the base with ``torch_dtype=compute_dtype`` and skips peft's call has them). Under bf16-true
    and bf16-true-autocast neither: they hold everything floating in bf16 by definition."""
    from .quantize import DTYPES

    loaded.quantized = True
    what = f"{q.bits}-bit" + (f" {q.type}{' + double quant' if q.double_quant else ''}, compute {q.compute_dtype}"
                              if q.bits == 4 else " LLM.int8")
    if precision in BF16_WEIGHTS:
        loaded.notes.append(f"base quantised ({what}, bitsandbytes); prepare_model_for_kbit_training not applied: "
                            f"its fp32 upcast contradicts {precision}")
        return
    if q.prepare == "none":
        dtype = DTYPES[q.compute_dtype]
        for p in loaded.model.parameters():
            if p.is_floating_point() and p.dtype != dtype:  # packed 4-bit (uint8) and int8 weights are not
                p.data = p.data.to(dtype)
        loaded.notes.append(f"base quantised ({what}, bitsandbytes); model.quantization.prepare: none: "
                            f"prepare_model_for_kbit_training not called, the non-quantised weights held in "
                            f"{q.compute_dtype}")
        return
    from peft import prepare_model_for_kbit_training

    # Checkpointing is switched on by build_model itself (non-reentrant), not by peft's reentrant default.
    loaded.model = prepare_model_for_kbit_training(loaded.model, use_gradient_checkpointing=False)
    loaded.notes.append(f"base quantised ({what}, bitsandbytes), prepared with peft.prepare_model_for_kbit_training")


def _build_factory(spec: ModelSpec, job: BuildContext, meta: bool) -> LoadedModel:
    assert spec.factory is not None
    with factory_guard(f"importing model.factory {spec.factory!r}", job.factory_timeout):
        fn = import_factory(spec.factory, job.folder)
    with torch.device("meta") if meta else contextlib.nullcontext():
        with factory_guard(f"model.factory {spec.factory!r}", job.factory_timeout):
            model = fn(spec.factory_mapping())
    if isinstance(model, type) and issubclass(model, torch.nn.Module):
        raise ModelError(f"model.factory {spec.factory!r} returned the class {model.__name__}, not an "
                         "instance: call it and return the module")
    if not isinstance(model, torch.nn.Module):
        raise ModelError(
            f"model.factory {spec.factory!r} returned {type(model).__name__}; expected a torch.nn.Module"
        )
    return LoadedModel(model, "factory", "custom", spec.factory, config=getattr(model, "config", None))


def _label_kwargs(head: str, label_names: list[str] | None) -> dict[str, Any]:
    """A classification head's size and class names, as transformers configs take them."""
    if head not in LABELLED_HEADS or not label_names:
        return {}
    return {"num_labels": len(label_names), "id2label": dict(enumerate(label_names)),
            "label2id": {n: i for i, n in enumerate(label_names)}}


def _hf_config(spec: ModelSpec, folder: Path, head: str, label_names: list[str] | None, tokenizer):
    """The transformers config the spec names (model.config, or the config of model.hf)."""
    import transformers

    extra = _label_kwargs(head, label_names)
    if spec.config is not None:
        cfg_map = dict(spec.config)
        model_type = cfg_map.pop("model_type")
        try:
            # The labels the data names win over a config's own (a described program's config carries them too:
            # passing both was "got multiple values for keyword argument 'id2label'", issue 44).
            config = transformers.AutoConfig.for_model(model_type, **(cfg_map | extra))
        except (ValueError, TypeError) as exc:
            if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
                # Raised by this very call (its arguments, not the config's values): pilotrun's own bug, not the
                # user's model.config (issue 44 blamed model.config for a keyword passed twice).
                raise
            raise ModelError(f"model.config: transformers cannot build a {model_type!r} config: {exc}") from None
        if tokenizer is not None and getattr(config, "pad_token_id", None) is None and head == "seq-classification":
            config.pad_token_id = tokenizer.pad_token_id
        return config
    target = spec.hf
    assert target is not None
    local = local_path(target, folder)
    try:
        config = transformers.AutoConfig.from_pretrained(str(local) if local else target, revision=spec.revision,
                                                         trust_remote_code=spec.trust_remote_code, **extra)
    except Exception as exc:
        raise ModelError(_hub_hint(exc, target)) from None
    return config


def _build_hf(spec: ModelSpec, job: BuildContext, label_names: list[str] | None, tokenizer, meta: bool,
              device: torch.device | str = "cpu") -> LoadedModel:
    from .quantize import quantized_from_config, quantized_from_pretrained

    quant = spec.quantization if not meta else None
    head, why = head_for(job.task, label_names)
    cls = _hf_classes(head)
    notes = [f"head: {head} ({why})"]
    if spec.config is not None or meta:
        config = _hf_config(spec, job.folder, head, label_names, tokenizer)
        try:
            with torch.device("meta") if meta else contextlib.nullcontext():
                model = cls.from_config(config, **_attention_kwargs(spec, meta))
        except (ValueError, ImportError) as exc:
            if _about_attention(spec, exc):
                raise _attention_error(spec, exc) from None
            raise ModelError(f"model.config: {exc}") from None
        if spec.config is not None:
            source = f"config ({spec.config['model_type']}, random init, seed {job.seed})"
        else:
            source = f"{spec.hf} (config only, on the meta device)"
        if quant is not None:
            model = quantized_from_config(cls, model, quant, device)
        return LoadedModel(model, "hf", head, source, notes, config=config)
    target = spec.hf
    assert target is not None
    local = local_path(target, job.folder)
    src = str(local) if local is not None else target
    kwargs = {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code,
              **_label_kwargs(head, label_names), **_attention_kwargs(spec, meta)}
    try:
        model = (quantized_from_pretrained(cls, src, quant, device, **kwargs) if quant is not None
                 else cls.from_pretrained(src, **kwargs))
    except Exception as exc:
        if _about_attention(spec, exc):
            raise _attention_error(spec, exc) from None
        raise ModelError(_hub_hint(exc, target)) from None
    source = target if local is None else f"{target} ({src})" if target != src else src
    if tokenizer is not None and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(model, "hf", head, source, notes, config=model.config)


def _attention_kwargs(spec: ModelSpec, meta: bool) -> dict[str, Any]:
    """transformers' ``attn_implementation`` for ``model.attn_implementation``. A meta build (the estimator's) of a
    flash model is built with sdpa: the flash-attn package runs on the GPU only, and the trace swaps in its own model
    of the kernel (models/attention.py)."""
    impl = spec.attn_implementation
    if impl is None:
        return {}
    return {"attn_implementation": "sdpa" if meta and impl.startswith("flash_attention") else impl}


def _about_attention(spec: ModelSpec, exc: Exception) -> bool:
    text = str(exc).lower()
    return spec.attn_implementation is not None and ("attention" in text or "attn" in text)


def _attention_error(spec: ModelSpec, exc: Exception) -> ModelError:
    return ModelError(f"model.attn_implementation: transformers cannot run {spec.attn_implementation!r} here: "
                      f"{type(exc).__name__}: {exc}. flash_attention_2/3 need the flash-attn package and a CUDA GPU; "
                      "pilot on such a machine, or set sdpa for a CPU pilot (the estimate still models the flash "
                      "kernel when the spec says it)", field="model.attn_implementation")


# What the per-op policies keep from the forward: matmul and attention outputs, whose recompute costs the most; every
# other op's output is recomputed in backward. selective keeps every matmul's; selective-N one matmul's in N within each
# checkpointed block (torchtitan's op policy is N = 2: its save list of mm and the attention kernels, "except every
# second mm"). The attention kernels are always kept.
_MATMUL_OPS = ("mm", "addmm", "bmm")
_ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention")


def _aten_ops(names: tuple[str, ...]) -> set:
    return {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}


def per_op_policy(stride: int, attention_ops: frozenset = frozenset()):
    """A fresh policy function for one checkpointed call: keep the attention kernels' outputs (aten's, and
    ``attention_ops``, e.g. the estimator's model of the target's kernel) and the 1st, (1+N)th, (1+2N)th... matmul's
    of the block, recompute the rest. The forward and its recompute count their matmuls apart, so both make the same
    choice; the count starts again at every call, so every block keeps the same matmuls (torchtitan's counter runs on
    across steps, so a block of an odd number of matmuls alternates between the two halves: this is the half that
    keeps the first, the larger for a Llama block: q, v, gate and down of its seven)."""
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls = _aten_ops(_MATMUL_OPS)
    kept = _aten_ops(_ATTENTION_OPS) | set(attention_ops)
    counts = {False: 0, True: 0}   # matmuls seen by the forward (False) and by the recompute (True)

    def policy(ctx, op, *args, **kwargs):
        if op in matmuls:
            n = counts[ctx.is_recompute]
            counts[ctx.is_recompute] = n + 1
            return CheckpointPolicy.MUST_SAVE if n % stride == 0 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _per_op_context(stride: int):
    """``context_fn`` for torch.utils.checkpoint: a per-op policy as torch's selective checkpoint contexts, each
    checkpointed call with its own matmul count."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from .attention import modelled_attention_ops

    def context():
        return create_selective_checkpoint_contexts(per_op_policy(stride, modelled_attention_ops()))

    return context


def checkpoint_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's checkpointable blocks in order (transformers' GradientCheckpointingLayer: its decoder layers)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers 4 before the class existed
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_activation_checkpointing(model: torch.nn.Module, policy: str = "full") -> bool:
    """Non-reentrant activation checkpointing through the model's own switch (transformers 4 or 5), with the
    ``train.activation_checkpointing`` policy: ``full``, ``selective`` (the matmul outputs kept), ``selective-N`` (one
    matmul output in N kept) or ``every-N`` (one block in N recomputed). False when the model has no switch; ModelError
    when it cannot take the policy."""
    new = getattr(model, "activation_checkpointing_enable", None)  # transformers 5
    old = getattr(model, "gradient_checkpointing_enable", None)
    blocks = checkpoint_blocks(model) if policy.startswith("every-") else []
    if policy.startswith("every-") and (new is not None or old is not None) and not blocks:
        raise ModelError(f"train.activation_checkpointing: {policy} recomputes one transformers block in "
                         f"{policy.removeprefix('every-')}, and this model has none (GradientCheckpointingLayer); "
                         "use true (full)", field="train.activation_checkpointing")
    kwargs: dict = {"use_reentrant": False}
    if (stride := matmul_stride(policy)) is not None:
        kwargs["context_fn"] = _per_op_context(stride)
    if new is not None:
        new(activation_checkpointing_kwargs=kwargs)
    elif old is not None:
        try:
            old(gradient_checkpointing_kwargs=kwargs)
        except TypeError:  # a user's own switch without the keyword
            if policy != "full":
                raise ModelError(f"train.activation_checkpointing: {policy} needs a switch that takes checkpoint "
                                 "arguments (transformers' gradient_checkpointing_enable); use true (full) for this "
                                 "model", field="train.activation_checkpointing") from None
            old()
    else:
        return False
    if blocks:
        every = int(policy.removeprefix("every-"))
        for i, block in enumerate(blocks):
            block.gradient_checkpointing = i % every == 0  # type: ignore[assignment]  # a bool transformers reads
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    return True


def parameter_count(model: torch.nn.Module) -> tuple[int, int]:
    from .adapters import logical_numel

    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = logical_numel(p)  # a 4-bit weight: its own size, not its packed uint8 elements
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable
