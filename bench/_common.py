"""What every benchmark records beside its numbers: the machine, and where the JSON goes."""
from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def machine(**extra) -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "system": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    info.update(extra)
    return info


def write_results(name: str, payload: dict, out: Path = RESULTS) -> Path:
    """bench/results/<name>-<device>-<date>.json, with the machine it ran on."""
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    path = out / f"{name}-{device}-{stamp}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"written {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return path
