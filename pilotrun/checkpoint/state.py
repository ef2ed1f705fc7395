"""The full training state on disk: model, optimizer, scheduler, scaler, every RNG, data position.

Everything loads with ``torch.load(weights_only=True)`` or from JSON: RNG states
are tensors or lists of ints, the scheduler is its ``state_dict`` (plain numbers),
nothing is pickled.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from .io import AtomicFolder


def capture_rng() -> tuple[dict, dict]:
    """(JSON part, tensor part) of every RNG stream: python, numpy, torch CPU, each accelerator."""
    version, state, gauss = random.getstate()
    js: dict = {"python": {"version": version, "state": list(state), "gauss": gauss}}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        js["numpy"] = {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached)}
    except ImportError:  # pragma: no cover
        pass
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, st in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = st
    return js, tensors


def restore_rng(js: dict, tensors: dict) -> None:
    py = js["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "numpy" in js:
        import numpy as np

        n = js["numpy"]
        np.random.set_state((n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(tensors["torch_cpu"])
    for key, st in tensors.items():
        if key.startswith("cuda_") and torch.cuda.is_available():
            torch.cuda.set_rng_state(st, int(key.split("_")[1]))


def _torch_save(obj, fh) -> None:
    torch.save(obj, fh)


def save_checkpoint(folder: Path, trainer, config: dict, lock_hash: str | None = None) -> AtomicFolder:
    """Write the trainer's full state to ``folder`` atomically; returns the written folder's record."""
    rng_json, rng_tensors = capture_rng()
    meta = {"step": trainer.step, "config_hash": lock_hash}
    with AtomicFolder(folder, "checkpoint", meta) as f:
        f.write_with("model.pt", _torch_save, trainer.model.state_dict())
        f.write_with("optimizer.pt", _torch_save, trainer.optimizer.state_dict())
        f.write_json("scheduler.json", trainer.scheduler.state_dict())
        if trainer.scaler is not None:
            f.write_json("scaler.json", trainer.scaler.state_dict())
        f.write_with("rng.pt", _torch_save, rng_tensors)
        f.write_json("rng.json", rng_json)
        f.write_json("trainer_state.json", trainer.state())
        f.write_json("config.json", config)
    return f
