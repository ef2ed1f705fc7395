"""GPU tier: runs only where CUDA/ROCm is visible (never in CI here)."""
from __future__ import annotations

import pytest
import torch

from pilotrun.config import load_spec
from pilotrun.measure import StageMeter
from pilotrun.pilot import PilotOptions, run_pilot

from .conftest import copy_fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA/ROCm device")]


def test_allocator_counters_are_kept_apart():
    dev = torch.device("cuda", 0)
    with StageMeter(dev) as m:
        x = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
        del x
    mem = m.memory
    assert mem["source"] == "cuda-allocator"
    assert mem["peak_allocated_bytes"] >= 64 << 20
    assert mem["peak_reserved_bytes"] >= mem["peak_allocated_bytes"]
    assert mem["device_used_bytes"] and mem["device_used_bytes"] >= mem["peak_reserved_bytes"]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_toy_pilot_on_cuda(tmp_path, precision):
    spec = load_spec(copy_fixture("toy", tmp_path), [f"train.precision={precision}", "train.device=cuda"])
    result = run_pilot(spec, PilotOptions(out_dir=tmp_path / "o", ledger_path=tmp_path / "l.sqlite"))
    rows = {r["gate"]: r for r in result.rows}
    assert not result.failed, [(r["gate"], r["reason"]) for r in result.rows]
    assert rows["first_step"]["memory"]["peak_reserved_bytes"] >= rows["first_step"]["memory"]["peak_allocated_bytes"] > 0
