"""What every benchmark records beside its numbers: the machine, and where the JSON goes."""
from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from pilotrun.devices import query_devices

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def _device() -> tuple[str, str]:
    """(device type, its name) of the accelerator in use, ("cpu", "cpu") without one: pilotrun's one device query."""
    inv = query_devices()
    return (inv.runtime.device_type, inv.names[0]) if inv.runtime.indexed and inv.count else ("cpu", "cpu")


def machine(**extra) -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "system": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "device": _device()[1]}
    info.update(extra)
    return info


def write_results(name: str, payload: dict, out: Path = RESULTS) -> Path:
    """bench/results/<name>-<device>-<date>.json, with the machine it ran on."""
    out.mkdir(parents=True, exist_ok=True)
    device = _device()[0]
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    path = out / f"{name}-{device}-{stamp}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"written {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return path
