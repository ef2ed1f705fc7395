"""GPU tier: runs only where CUDA/ROCm is visible (never in CI here)."""
from __future__ import annotations

import pytest
import torch

from pilotrun.config import load_spec
from pilotrun.measure import StageMeter
from pilotrun.pilot import PilotOptions, run_pilot
from tests.conftest import SPEC_ORDER, copy_fixture

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


@pytest.mark.process
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_toy_pilot_on_cuda(tmp_path, precision):
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name(0)} has no bf16")
    spec = load_spec(copy_fixture("toy", tmp_path), [f"train.precision={precision}", "train.device=cuda"])
    result = run_pilot(spec, PilotOptions(out_dir=tmp_path / "o", ledger_path=tmp_path / "l.sqlite"))
    rows = {r["gate"]: r for r in result.rows}
    # Every gate ran: a pilot whose gates all skipped (no device after all, an unsupported precision) fails here.
    assert list(rows) == SPEC_ORDER
    assert {r["verdict"] for r in result.rows} <= {"pass", "warn"}, [(r["gate"], r["verdict"], r["reason"])
                                                                     for r in result.rows]
    assert result.exit_code == 0 and not result.failed
    for gate in ("first_step", "steady_step", "eval"):  # on the GPU, at the precision asked, by its allocator
        assert rows[gate]["inputs"]["device"].startswith("cuda") and rows[gate]["inputs"]["precision"] == precision
        mem = rows[gate]["memory"]
        assert mem["source"] == "cuda-allocator", (gate, mem)
        assert mem["peak_reserved_bytes"] >= mem["peak_allocated_bytes"] > 0, (gate, mem)
    assert rows["steady_step"]["details"]["seconds_per_update"] > 0


def test_a_save_behind_the_job_copies_the_device_state_to_pinned_host_memory(tmp_path):
    from pilotrun.checkpoint import saving, start_checkpoint, verify_folder
    from pilotrun.checkpoint.state import _load_sharded

    dev = torch.device("cuda", 0)

    class Job:
        def __init__(self) -> None:
            self.model = torch.nn.Linear(64, 64).to(dev)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
            self.model(torch.ones(2, 64, device=dev)).sum().backward()
            self.optimizer.step()
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: 1.0)
            self.scaler, self.step = None, 1

        def state(self) -> dict:
            return {"step": 1, "examples_seen": 2, "data_position": {"epoch": 0, "micro_index": 1}}

    job = Job()
    assert saving.saves_behind(dev)
    saved = job.model.weight.detach().cpu()
    pending = start_checkpoint(tmp_path / "step-000001", job, {"c": 1})
    assert any(b.is_pinned() for b in saving._STAGING.buffers)  # the device's storages; the CPU RNG state is not
    job.model(torch.ones(2, 64, device=dev)).sum().backward()
    job.optimizer.step()  # the job goes on as soon as the copy is done
    pending.wait()
    saving.release_staging()
    verify_folder(tmp_path / "step-000001")
    weights, _ = _load_sharded(tmp_path / "step-000001", "model")
    assert torch.equal(weights["weight"], saved)
