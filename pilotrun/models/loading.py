"""Building the model and tokenizer a spec names: a factory, a Hugging Face folder or Hub id, or a config.

Nothing here downloads on its own initiative: a Hub id is passed to transformers,
which uses its cache and honours ``HF_HUB_OFFLINE``; a failure says how to fix it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config.spec import Spec, import_factory


class ModelError(Exception):
    """The model or tokenizer cannot be built as specified; the message says why and what to change."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    kind: str  # hf or factory
    head: str  # causal-lm, seq-classification or custom
    source: str
    notes: list[str] = field(default_factory=list)


def _hub_hint(exc: Exception, target: str) -> str:
    return (
        f"could not load {target!r}: {type(exc).__name__}: {exc}. If this is a Hub id, this machine may have no "
        "network: download it elsewhere and point model.hf at the local folder"
    )


def _local(spec: Spec, target: str) -> Path | None:
    """The local file or folder a model/tokenizer value names, or None for a Hub id."""
    try:
        p = spec.resolve(target)
    except FileNotFoundError:
        return None
    return p if p.exists() else None


def load_tokenizer(spec: Spec):
    """The tokenizer for built-in tasks (None for factory data that brings its own)."""
    target = spec.model.tokenizer or spec.model.hf
    if target is None:
        return None
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    local = _local(spec, target)
    try:
        if local is not None and local.is_file():
            tok = PreTrainedTokenizerFast(tokenizer_file=str(local))
        elif local is not None:
            tok = AutoTokenizer.from_pretrained(str(local), trust_remote_code=spec.model.trust_remote_code)
        else:
            tok = AutoTokenizer.from_pretrained(target, revision=spec.model.revision, trust_remote_code=spec.model.trust_remote_code)
    except Exception as exc:
        raise ModelError(_hub_hint(exc, target)) from None
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def _hf_classes(head: str):
    import transformers

    if head == "seq-classification":
        return transformers.AutoModelForSequenceClassification
    return transformers.AutoModelForCausalLM


def _head_for(spec: Spec, label_names: list[str] | None) -> tuple[str, str]:
    if spec.data.task is not None:
        return spec.data.task, f"data.task is {spec.data.task}"
    if label_names:
        return "seq-classification", "the data factory returned label_names, so a sequence-classification head"
    return "causal-lm", "the data factory returned no label_names, so a causal-LM head"


def build_model(spec: Spec, label_names: list[str] | None = None, tokenizer=None) -> LoadedModel:
    """Build (random init, seeded) or load the model. Raises :class:`ModelError`."""
    torch.manual_seed(spec.seed)
    if spec.model.factory is not None:
        fn = import_factory(spec.model.factory, spec.folder)
        model = fn(spec.model_mapping())
        if isinstance(model, type) and issubclass(model, torch.nn.Module):
            raise ModelError(f"model.factory {spec.model.factory!r} returned the class {model.__name__}, not an "
                             "instance: call it and return the module")
        if not isinstance(model, torch.nn.Module):
            raise ModelError(
                f"model.factory {spec.model.factory!r} returned {type(model).__name__}; expected a torch.nn.Module"
            )
        loaded = LoadedModel(model, "factory", "custom", spec.model.factory)
    else:
        import transformers

        head, why = _head_for(spec, label_names)
        cls = _hf_classes(head)
        extra: dict[str, Any] = {}
        if head == "seq-classification" and label_names:
            extra = {
                "num_labels": len(label_names),
                "id2label": {i: n for i, n in enumerate(label_names)},
                "label2id": {n: i for i, n in enumerate(label_names)},
            }
        if spec.model.config is not None:
            cfg_map = dict(spec.model.config)
            model_type = cfg_map.pop("model_type")
            try:
                config = transformers.AutoConfig.for_model(model_type, **cfg_map, **extra)
            except (ValueError, TypeError) as exc:
                raise ModelError(f"model.config: transformers cannot build a {model_type!r} config: {exc}") from None
            if tokenizer is not None and getattr(config, "pad_token_id", None) is None and head == "seq-classification":
                config.pad_token_id = tokenizer.pad_token_id
            try:
                model = cls.from_config(config)
            except ValueError as exc:
                raise ModelError(f"model.config: {exc}") from None
            source = f"config ({model_type}, random init, seed {spec.seed})"
        else:
            target = spec.model.hf
            local = _local(spec, target)
            src = str(local) if local is not None else target
            try:
                model = cls.from_pretrained(
                    src, revision=spec.model.revision, trust_remote_code=spec.model.trust_remote_code, **extra
                )
            except Exception as exc:
                raise ModelError(_hub_hint(exc, target)) from None
            source = target if local is None else f"{target} ({src})" if target != src else src
            if tokenizer is not None and getattr(model.config, "pad_token_id", None) is None:
                model.config.pad_token_id = tokenizer.pad_token_id
        loaded = LoadedModel(model, "hf", head, source, notes=[f"head: {head} ({why})"])
    if spec.train.activation_checkpointing:
        if not enable_activation_checkpointing(loaded.model):
            raise ModelError(
                "train.activation_checkpointing is true but the model has no gradient_checkpointing_enable(); "
                "wrap its blocks with torch.utils.checkpoint in the factory, or set it to false"
            )
        loaded.notes.append("activation checkpointing on (non-reentrant)")
    return loaded


def enable_activation_checkpointing(model: torch.nn.Module) -> bool:
    """Non-reentrant activation checkpointing through the model's own switch (transformers 4 or 5)."""
    new = getattr(model, "activation_checkpointing_enable", None)  # transformers 5
    old = getattr(model, "gradient_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs={"use_reentrant": False})
    elif old is not None:
        try:
            old(gradient_checkpointing_kwargs={"use_reentrant": False})
        except TypeError:  # a user's own switch without the keyword
            old()
    else:
        return False
    if hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = False
    return True


def parameter_count(model: torch.nn.Module) -> tuple[int, int]:
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return total, trainable


def weight_files(folder: Path) -> list[Path]:
    """Files that define a local model: weights, configs and tokenizer files."""
    if folder.is_file():
        return [folder]
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
