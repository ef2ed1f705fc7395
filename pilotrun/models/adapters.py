"""A LoRA adapter on a frozen base, built with ``peft`` (never re-implemented), and what the gates read about it:
trainable vs frozen parameters and bytes, the adapter's own weights, and the frozen base's identity.

The base's identity (:func:`base_identity`) is a sha256 over the base's tensors as built (every parameter peft
did not add): a checkpoint holds the adapter alone, so a restore proves it is loading onto the same base by
comparing this, and a fresh process that loads an exported adapter compares it with ``base.json``'s. Fingerprints
use it in place of the frozen parameters' digests: the base is checked once, as built.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..config.sections import BF16_WEIGHTS, AdapterSpec, ModelSpec
from ..config.spec import BuildContext

# peft's task types by pilotrun's model head: the task type picks the PeftModel subclass, whose forward passes
# labels through, and for classification keeps the new head trainable (modules_to_save).
TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq-classification": "SEQ_CLS", "token-classification": "TOKEN_CLS",
              "seq2seq-lm": "SEQ_2_SEQ_LM"}


class AdapterError(ValueError):
    """The adapter cannot be applied as specified; ``field`` is the spec key to change."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's Linear layers (bitsandbytes' Linear4bit and Linear8bitLt are Linear
    subclasses): what ``target_modules`` may name."""
    return sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                   if isinstance(mod, torch.nn.Linear) and name})


def check_targets(model: torch.nn.Module, adapter: AdapterSpec) -> None:
    """Every named target is the last name of a Linear in the model (or ``all-linear``); else AdapterError listing
    the model's Linear names."""
    if adapter.target_modules == "all-linear":
        return
    names = linear_module_names(model)
    missing = [t for t in adapter.target_modules if t not in names]
    if missing:
        raise AdapterError("model.adapter.target_modules", (
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not the name of a Linear layer in "
            f"{type(model).__name__}; its Linear layers are named: {', '.join(names) or '(none)'} — list some of "
            "those, or use all-linear"))


def lora_config(adapter: AdapterSpec, head: str):
    from peft import LoraConfig

    targets = adapter.target_modules if adapter.target_modules == "all-linear" else list(adapter.target_modules)
    # peft annotates lora_alpha as int but computes alpha / r in float
    alpha: Any = adapter.alpha
    return LoraConfig(r=adapter.r, lora_alpha=alpha, lora_dropout=adapter.dropout, target_modules=targets,
                      task_type=TASK_TYPES.get(head), bias="none")


def apply_adapter(model: torch.nn.Module, adapter: AdapterSpec, head: str, *, keep_dtype: bool = False):
    """``peft.get_peft_model`` with the spec's LoRA: the base frozen, the adapter trainable. ``keep_dtype`` leaves
    the adapter in the base's dtype (bf16-true); otherwise peft upcasts a bf16/fp16 adapter to fp32."""
    from peft import get_peft_model

    check_targets(model, adapter)
    try:
        return get_peft_model(model, lora_config(adapter, head), autocast_adapter_dtype=not keep_dtype)
    except ValueError as exc:  # peft's own refusal (e.g. all-linear on a model with no Linear but the head)
        raise AdapterError("model.adapter.target_modules",
                           f"peft cannot adapt {type(model).__name__}: {exc}; its Linear layers are named: "
                           f"{', '.join(linear_module_names(model)) or '(none)'}") from None


def is_adapter_model(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PeftModel (itself otherwise): its type decides the loss normalisation."""
    return model.get_base_model() if is_adapter_model(model) else model  # type: ignore[operator]


def _bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


@dataclass(frozen=True)
class ParameterSplit:
    """Trainable vs frozen parameters and their bytes as stored (a 4-bit weight counts its packed uint8 bytes)."""

    trainable: int
    frozen: int
    trainable_bytes: int
    frozen_bytes: int

    @property
    def trainable_share(self) -> float:
        total = self.trainable + self.frozen
        return self.trainable / total if total else 0.0

    def as_dict(self) -> dict:
        return {"trainable_parameters": self.trainable, "frozen_parameters": self.frozen,
                "trainable_bytes": self.trainable_bytes, "frozen_bytes": self.frozen_bytes,
                "trainable_share": round(self.trainable_share, 6)}


def logical_numel(p: torch.Tensor) -> int:
    """Parameters a tensor stands for: a bitsandbytes 4-bit weight packs two per uint8 element; its quant_state
    keeps the weight's own shape."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else p.numel()


def parameter_split(model: torch.nn.Module) -> ParameterSplit:
    """Counts are parameters (a 4-bit weight's logical size), bytes are storage as held."""
    unique = {id(p): p for p in model.parameters()}.values()
    train = [p for p in unique if p.requires_grad]
    frozen = [p for p in unique if not p.requires_grad]
    return ParameterSplit(sum(logical_numel(p) for p in train), sum(logical_numel(p) for p in frozen),
                          sum(_bytes(p) for p in train), sum(_bytes(p) for p in frozen))


def is_adapter_parameter(name: str) -> bool:
    """A parameter peft added (LoRA matrices, the trainable copy of a head it keeps): not part of the base."""
    return ".lora_" in name or ".modules_to_save." in name


def base_identity(model: torch.nn.Module) -> str:
    """sha256 over the base's parameters (every one peft did not add), their shapes, dtypes and bytes, in order:
    the same for the training job and for a fresh process that loads the exported adapter onto the rebuilt base
    (call it right after the build, before a forward)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if is_adapter_parameter(name):
            continue
        t = p.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        flat = t.contiguous().reshape(-1)
        h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()


def base_reference(m: ModelSpec, job: BuildContext, loaded, label_names: list[str] | None, spec_record: dict) -> dict:
    """What an exported adapter needs to be loaded on its base again (``base.json``): where the base comes from
    (the spec's ``model`` section, built with ``job``), the spec that builds it (``spec_record``,
    ``Spec.record()``), and its identity to check against."""
    if m.hf is not None:
        where = f"the Hugging Face model {m.hf}" + (f" at revision {m.revision}" if m.revision else "")
    elif m.config is not None:
        where = f"a {m.config.get('model_type')} model built from the spec's model.config with seed {job.seed}"
    else:
        where = f"the model returned by the factory {m.factory} (seed {job.seed})"
    quant = m.quantization
    how = (f"load {where}"
           + (f", quantised {quant.bits}-bit with bitsandbytes as in base.json's spec" if quant is not None else "")
           + (", its floating-point weights cast to bf16" if job.precision in BF16_WEIGHTS else "")
           + "; then peft.PeftModel.from_pretrained(base, this_folder)")
    return {"source": loaded.source, "hf": m.hf, "revision": m.revision, "seed": job.seed, "head": loaded.head,
            "label_names": label_names, "precision": job.precision,
            "quantization": None if quant is None else {"bits": quant.bits, "type": quant.type,
                                                         "double_quant": quant.double_quant,
                                                         "compute_dtype": quant.compute_dtype},
            "base_identity": loaded.base_identity, "how_to_load": how,
            "spec": spec_record}


def merged_copy(model: torch.nn.Module, loaded) -> tuple[torch.nn.Module | None, str | None]:
    """A copy of the model with the adapter folded into the base (peft ``merge_and_unload``), or None and why not.
    A quantised base is not merged: the sum would be rounded back into 4/8-bit weights (a different model from the
    one trained), and the unquantised base is not in this process."""
    import copy

    if loaded.quantized:
        return None, ("not written: merging into a quantised base rounds the adapter into its 4/8-bit weights; "
                      "merge onto the unquantised base (base.json says which) with peft's merge_and_unload")
    return copy.deepcopy(model).merge_and_unload(), None  # type: ignore[operator]
