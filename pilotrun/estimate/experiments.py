"""Adapter jobs as estimate, select, plan and the report show them, and adapters as *other experiments*.

Pure functions over a trace. A LoRA or QLoRA job trains different parameters than a full fine-tune: its result
is another experiment. So the advisor (``advise.py``) never proposes one as a memory fix; the selection sheet may
list them next to a full fine-tune, each labelled "a different experiment".

Example::

    view = adapter_view(trace, spec)     # None for a full fine-tune
    view["trainable_share"], view["adapter_bytes"], view["merged_export"]
    for label, other in other_experiments(spec): ...
"""
from __future__ import annotations

import copy

from ..config.load import set_dotted, spec_from_mapping
from ..config.spec import Spec
from ..humanize import human_bytes, human_seconds

# Merging writes the merged model once; with no pilot measuring the disk, this is plan.Assumptions' default.
DISK_MB_S = 1000.0

# The experiments the selection sheet may list beside a full fine-tune: the settings most fine-tuning guides use
# (LoRA r=16, alpha=32 on every Linear; QLoRA: nf4 with double quantisation and bf16 compute, as in the QLoRA
# paper, Dettmers et al. 2023, arXiv:2305.14314).
ALTERNATIVES = {
    "LoRA": {"model.adapter": {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"},
             "train.precision": "bf16-true"},
    "QLoRA": {"model.adapter": {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"},
              "model.quantization": {"bits": 4, "type": "nf4", "double_quant": True, "compute_dtype": "bf16"},
              "train.precision": "bf16"},
}


def is_adapter_job(spec: Spec) -> bool:
    return spec.model.adapter is not None


def adapter_view(trace: dict, spec: Spec, disk_mb_s: float = DISK_MB_S) -> dict | None:
    """What an adapter job trains and writes; None for a full fine-tune."""
    a = trace.get("adaptation") or {}
    if spec.model.adapter is None or not a:
        return None
    total = trace["parameters"]
    view = {
        "trainable_parameters": trace["trainable_parameters"],
        "parameters": total,
        "trainable_share": trace["trainable_parameters"] / total if total else 0.0,
        "adapter_bytes": a["adapter_bytes"],
        "adapted_layers": a["adapted_layers"],
        "frozen_base_bytes": trace["parameter_bytes"] - a["adapter_bytes"],
        "quantized_bytes": a["quantized_bytes"],
        # of quantized_bytes, the absmax and codes: not parameters to FSDP, so whole on every rank
        "quant_state_bytes": a.get("quant_state_bytes", 0),
        "quantized_layers": a["quantized_layers"],
        "dequantized_peak_bytes": a["dequantized_peak_bytes"],
        "preparation": a.get("preparation", ""),   # a quantised base's QLoRA preparation, as modelled
        # save holds the adapter, the optimizer and the rest of the training state, never the frozen base
        "checkpoint_bytes": a["adapter_bytes"] + trace["optimizer_state_bytes"],
        "label": label(spec),
        "merged_export": None,
    }
    if spec.export.merge:
        seconds = a["merged_bytes"] / (disk_mb_s * 1e6)
        view["merged_export"] = {
            "bytes": a["merged_bytes"], "seconds": seconds,
            "reason": (f"the base with the adapter merged in: {a['merged_bytes'] / 1e9:.2f} GB written at "
                       f"{disk_mb_s:g} MB/s (assumed; a pilot's export row measures it); the merge's matmuls "
                       "(r x (in + out) per layer) are negligible beside the write"),
        }
    return view


def label(spec: Spec) -> str:
    """'LoRA r=16 on all-linear' / 'QLoRA r=16 on q_proj, v_proj (4-bit nf4 base)'."""
    a = spec.model.adapter
    if a is None:
        return "full fine-tune"
    q = spec.model.quantization
    targets = a.target_modules if isinstance(a.target_modules, str) else ", ".join(a.target_modules)
    if q is None:
        return f"LoRA r={a.r} on {targets}"
    base = f"{q.bits}-bit {q.type} base" if q.bits == 4 else "8-bit base"
    return f"{'QLoRA' if q.bits == 4 else 'LoRA'} r={a.r} on {targets} ({base})"


def other_experiments(spec: Spec) -> list[tuple[str, Spec]]:
    """For a full fine-tune of a transformers model: LoRA and QLoRA variants of the same job, each labelled as
    a different experiment. None for adapter jobs or a factory model (peft needs to know its Linear layers)."""
    if spec.model.adapter is not None or spec.model.factory is not None:
        return []
    out = []
    for changes in ALTERNATIVES.values():
        raw = copy.deepcopy(spec.written)
        for key, value in changes.items():
            set_dotted(raw, key, copy.deepcopy(value))
        other = spec_from_mapping(raw, spec.source, check_files=False)
        out.append((f"a different experiment: {label(other)}, {other.train.precision}", other))
    return out


OTHER_EXPERIMENT_NOTE = ("rows marked 'a different experiment' train only an adapter on the frozen (or quantised) "
                         "base: their result is another model, so they are listed beside the job, never offered as a "
                         "memory fix for it")


def adapter_line(view: dict) -> str:
    """One line for the console and the report: what is trained, its size, and the merged export."""
    text = (f"{view['label']}: {view['trainable_parameters']:,} trainable of {view['parameters']:,} parameters "
            f"({view['trainable_share']:.2%}); adapter {human_bytes(view['adapter_bytes'])}, frozen base "
            f"{human_bytes(view['frozen_base_bytes'])}")
    if view["quantized_layers"]:
        text += (f" ({view['quantized_layers']} quantised layers: {human_bytes(view['quantized_bytes'])}, "
                 f"dequantised in flight up to {human_bytes(view['dequantized_peak_bytes'])})")
        if view.get("preparation"):
            text += f"; QLoRA preparation {view['preparation']}"
    text += f"; checkpoint {human_bytes(view['checkpoint_bytes'])} (adapter + optimizer state)"
    merged = view.get("merged_export")
    if merged:
        text += f"; merged export {human_bytes(merged['bytes'])}, about {human_seconds(merged['seconds'])}"
    return text
