"""Reload this archive's model in a fresh process and rerun the fixed control inputs.

    python rerun_control.py          # exit 0: outputs match those recorded at the end of the run
                                     # exit 1: they differ (the max difference is printed)

Copied into every ``pilotrun archive``; it needs torch, safetensors and (for Hugging Face models)
transformers — not pilotrun — and loads no pickle: weights and inputs are safetensors.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model

HERE = Path(__file__).resolve().parent
RTOL, ATOL = 1e-4, 1e-5  # the reload_eval gate's tolerance


def load(model_dir: Path) -> torch.nn.Module:
    if (model_dir / "base.json").exists():  # a PEFT adapter: pilotrun rebuilds its base and checks its identity
        from pilotrun.checkpoint.trust import LoadPolicy
        from pilotrun.workers.reload import load_artifact

        # trust: this archive's own manifest is checked file by file; the adapter is safetensors, never unpickled
        return load_artifact(model_dir, LoadPolicy.of([], trust=True))
    info_path = model_dir / "export.json"
    if info_path.exists():  # a factory model: its module travels in code/
        info = json.loads(info_path.read_text())
        sys.path.insert(0, str(HERE / "code"))
        module_name, _, func = info["factory"].partition(":")
        factory: Any = importlib.import_module(module_name)
        for part in func.split("."):
            factory = getattr(factory, part)
        torch.manual_seed(0)
        model = factory(info["model"])
        load_model(model, str(model_dir / "model.safetensors"))
        return model
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    return getattr(transformers, config.architectures[0]).from_pretrained(str(model_dir))


def outputs(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**batch)
    get = out.get if isinstance(out, dict) else lambda k: getattr(out, k, None)
    value = get("logits")
    if value is None:
        value = get("loss")
    if not isinstance(value, torch.Tensor):
        raise RuntimeError("the model returned neither logits nor loss")
    return value.detach().float().cpu()


def main() -> int:
    model = load(HERE / "model").eval()
    inputs = load_file(str(HERE / "control" / "inputs.safetensors"))
    expected = load_file(str(HERE / "control" / "outputs.safetensors"))["outputs"]
    got = outputs(model, inputs)
    if got.shape != expected.shape:
        print(f"MISMATCH: outputs of shape {tuple(got.shape)}, recorded {tuple(expected.shape)}")
        return 1
    diff = float((got - expected).abs().max()) if got.numel() else 0.0
    n = next(iter(inputs.values())).shape[0]
    if torch.allclose(got, expected, rtol=RTOL, atol=ATOL):
        print(f"match: {type(model).__name__} reproduces the recorded outputs on {n} control inputs "
              f"(max difference {diff:.3g})")
        return 0
    print(f"MISMATCH: max difference {diff:.3g} on {n} control inputs (rtol {RTOL:g}, atol {ATOL:g})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
