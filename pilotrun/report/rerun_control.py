"""Reload this archive's model in a fresh process and rerun the fixed control inputs.

    python rerun_control.py          # exit 0: outputs match those recorded at the end of the run
                                     # exit 1: they differ (the max difference is printed)
                                     # exit 2: the model is not the one the ledger recorded: nothing loaded

Copied into every ``pilotrun archive``; it needs torch, safetensors and (for Hugging Face models)
transformers — not pilotrun — and loads no pickle: weights and inputs are safetensors. Before anything is
loaded, ``model/manifest.json`` must be the manifest the ledger recorded (``run.json``'s ``recorded``), every file
it lists as listed, and the factory ``export.json`` names the run's own (its lock's): nothing the model folder
names is imported otherwise, and ``trust_remote_code`` is never taken from it.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model

HERE = Path(__file__).resolve().parent
RTOL, ATOL = 1e-4, 1e-5  # the reload_eval gate's tolerance


class Refused(Exception):
    """The archive's model is not what the ledger recorded: the message names the file and why."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def recorded_model(model_dir: Path) -> dict:
    """What the ledger recorded for this model (``run.json``), checked against ``model/`` file by file."""
    try:
        rec = json.loads((HERE / "run.json").read_text()).get("recorded") or {}
        manifest = json.loads((model_dir / "manifest.json").read_text())
    except (OSError, ValueError, AttributeError) as exc:
        raise Refused(f"run.json or model/manifest.json is unreadable ({type(exc).__name__}: {exc})") from None
    got, want = _sha256(model_dir / "manifest.json"), rec.get("model_manifest_sha256")
    if got != want:
        raise Refused(f"{model_dir / 'manifest.json'} (sha256 {got[:12]}…) is not the manifest recorded in the ledger "
                      f"for this run ({str(want)[:12]}…, run.json): the model was changed after the run")
    for name, info in sorted((manifest.get("files") or {}).items()):
        path = model_dir / name
        if ".." in Path(name).parts or Path(name).is_absolute() or path.is_symlink() or not path.is_file() \
                or _sha256(path) != info.get("sha256"):
            raise Refused(f"{path} is not the file its manifest lists (missing, a link, or other bytes)")
    return rec


def load(model_dir: Path) -> torch.nn.Module:
    rec = recorded_model(model_dir)
    if (model_dir / "base.json").exists():  # a PEFT adapter: pilotrun rebuilds its base and checks its identity
        from pilotrun.checkpoint.trust import LoadPolicy, LoadRefused
        from pilotrun.workers.reload import load_artifact

        # Known by the manifest the ledger recorded; the base's factory and trust_remote_code only as the run's spec
        # (its lock) had them, never as base.json says.
        policy = LoadPolicy.of([rec["model_manifest_sha256"]], factory=rec.get("factory"), bound_to_spec=True,
                               remote_code=bool(rec.get("trust_remote_code")))
        try:
            return load_artifact(model_dir, policy)
        except LoadRefused as exc:
            raise Refused(str(exc)) from None
    info_path = model_dir / "export.json"
    if info_path.exists():  # a factory model: its module travels in code/
        info = json.loads(info_path.read_text())
        if info.get("factory") != rec.get("factory") or not isinstance(rec.get("factory"), str):
            raise Refused(f"{info_path} names the factory {info.get('factory')!r}, but the run's own spec (its lock) "
                          f"names {rec.get('factory')!r}: only the spec's own factory is imported")
        sys.path.insert(0, str(HERE / "code"))
        module_name, _, func = rec["factory"].partition(":")
        factory: Any = importlib.import_module(module_name)
        for part in func.split("."):
            factory = getattr(factory, part)
        torch.manual_seed(0)
        model = factory(info["model"])
        load_model(model, str(model_dir / "model.safetensors"))
        return model
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_dir))  # trust_remote_code stays False
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
    try:
        model = load(HERE / "model").eval()
    except Refused as exc:
        print(f"REFUSED: {exc}; nothing was loaded", file=sys.stderr)
        return 2
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
