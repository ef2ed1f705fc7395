"""The inference artifact: safetensors weights plus what is needed to rebuild the model.

Hugging Face models use ``save_pretrained`` (config + safetensors, tied weights
handled) and the tokenizer beside them. Factory models get ``model.safetensors``
(shared tensors deduplicated by ``safetensors.torch.save_model``) and
``export.json`` naming the factory and the mapping it is called with.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from .io import AtomicFolder, CheckpointError


def export_model(folder: Path, model: torch.nn.Module, *, tokenizer=None, factory: str | None = None,
                 model_mapping: dict | None = None, spec_folder: str | None = None,
                 state_dict: dict | None = None) -> AtomicFolder:
    """``state_dict`` replaces the model's own (the full weights gathered from FSDP shards)."""
    with AtomicFolder(folder, "export", {"kind": "hf" if hasattr(model, "save_pretrained") else "factory"}) as f:
        save_pretrained = getattr(model, "save_pretrained", None)
        if save_pretrained is not None:
            save_pretrained(str(f.tmp), safe_serialization=True, state_dict=state_dict)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(f.tmp))
        elif state_dict is not None:
            from safetensors.torch import save_model

            # save_model, as for one process, so tied entries (one tensor under two names) are stored once
            # under the same name with the same metadata: the same file a single-process export writes.
            save_model(_StateDict(state_dict), str(f.tmp / "model.safetensors"))
        else:
            from safetensors.torch import save_model

            save_model(model, str(f.tmp / "model.safetensors"))
        if factory is not None:
            f.write_json("export.json", {"factory": factory, "model": model_mapping or {}, "spec_folder": spec_folder})
        f.adopt_existing()
    return f


BASE_JSON = "base.json"
MERGED = "merged"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def export_adapter(folder: Path, model: torch.nn.Module, base: dict, *, tokenizer=None,
                   merged: torch.nn.Module | None = None, merge_note: str | None = None) -> AtomicFolder:
    """The PEFT artifact of an adapter job: ``adapter_model.safetensors`` + ``adapter_config.json`` (peft's
    ``save_pretrained``: the adapter alone, never the frozen base), ``base.json`` (which base, how to load the adapter
    on it, the base's identity), the tokenizer, and with ``merged`` a plain model folder ``merged/`` with the adapter
    folded into the base weights (``merge_note`` says why a requested merge was not written)."""
    meta = {"kind": "adapter", "base_identity": base.get("base_identity")}
    with AtomicFolder(folder, "export", meta) as f:
        model.save_pretrained(str(f.tmp), safe_serialization=True)  # type: ignore[operator]
        missing = [n for n in ADAPTER_FILES if not (f.tmp / n).is_file()]
        if missing:
            raise CheckpointError(f"peft's save_pretrained wrote no {', '.join(missing)} in {folder}")
        f.write_json(BASE_JSON, {**base, "merged": MERGED if merged is not None else None, "merge_note": merge_note})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(f.tmp))
        if merged is not None:
            merged.save_pretrained(str(f.tmp / MERGED), safe_serialization=True)  # type: ignore[operator]
            if tokenizer is not None:
                tokenizer.save_pretrained(str(f.tmp / MERGED))
        f.adopt_existing()
    return f


class _StateDict(torch.nn.Module):
    """A module whose ``state_dict()`` is a given mapping: what ``safetensors.torch.save_model`` reads."""

    def __init__(self, state: dict) -> None:
        super().__init__()
        self._state = state

    def state_dict(self, *args, **kwargs):
        return {k: v.detach() for k, v in self._state.items()}


def safetensors_tensor_count(folder: Path) -> int:
    """Open every safetensors file's header (no tensor data is read) and count tensors (the top folder's files: a
    merged model under ``merged/`` is counted on its own)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no .safetensors file")
    total = 0
    for p in files:
        try:
            with safe_open(str(p), framework="pt") as fh:
                total += len(list(fh.keys()))
        except Exception as exc:
            raise CheckpointError(f"{p} is not a readable safetensors file: {exc}") from None
    return total
