"""The largest micro batch `select` reports, checked against a second real trace at that batch.

Issue 13: with activation checkpointing the traced peak is the optimizer step, whose breakdown holds no
activations; scaling that breakdown said "largest micro batch 1023" for the 7B at length 4096. The
4-layer 7B shape (same width, vocabulary and length) is traced in seconds and shows the same thing.
"""
from __future__ import annotations

import json

import pytest

from pilotrun.config import load_spec
from pilotrun.estimate.catalog import load_catalog
from pilotrun.estimate.model import estimate_fit, largest_scale_that_fits
from pilotrun.estimate.worker import trace_in_subprocess
from tests.conftest import EXAMPLES, pilotrun_cli
from tests.estimate.test_estimate import SHALLOW, synthetic_trace

GiB = 2**30
SPEC = EXAMPLES / "llama-7b-estimate" / "pilot.yaml"
AC = "train.activation_checkpointing=true"


def test_activations_scale_from_the_backward_moment_not_the_optimizer_step():
    """A stage whose overall peak is the step (no activations) still grows with the batch from backward."""
    trace = synthetic_trace(params=4 * GiB, acts=0, opt=16 * GiB)
    compute = {"parameters": 4 * GiB, "gradients": 4 * GiB, "optimizer": 8 * GiB, "activations": 2 * GiB}
    step = {"parameters": 4 * GiB, "gradients": 4 * GiB, "optimizer": 16 * GiB, "activations": 0}
    for name in ("first_step", "steady_step"):
        trace["stages"][name]["phases"] = {"compute": [{"bytes": 18 * GiB, "breakdown": compute}],
                                           "optimizer": [{"bytes": 24 * GiB, "breakdown": step}]}
    h100 = load_catalog()["H100-80GB"]
    at1 = estimate_fit(trace, h100, "single", 1)
    at8 = estimate_fit(trace, h100, "single", 1, micro_scale=8)
    assert at1["stages"]["steady_step"]["limiting_phase"] == "optimizer"
    assert at8["stages"]["steady_step"]["limiting_phase"] == "compute"
    # 8 examples: 16 GiB of other state + 16 GiB of activations, over the step's 24 GiB.
    assert at8["peak_allocated_bytes"] - at1["peak_allocated_bytes"] == pytest.approx(8 * GiB, rel=0.01)
    scale = largest_scale_that_fits(trace, h100, "single", 1, 0.05)
    assert 20 < scale < 40  # about (0.95 x 79 GiB - 16 GiB - overheads) / 2 GiB, not the 1024 ceiling


def test_a_gpu_that_runs_one_micro_batch_per_update_never_holds_an_earlier_ones_gradients():
    """The trace runs two micro batches per update; the second's moments hold the first's gradients. Split over as
    many GPUs as micro batches (torchtitan's local batch), each GPU runs one: those moments are not its peak."""
    trace = synthetic_trace(params=4 * GiB, acts=0, opt=8 * GiB)
    first = {"parameters": 4 * GiB, "gradients": 0, "optimizer": 8 * GiB, "activations": 10 * GiB}
    later = {"parameters": 4 * GiB, "gradients": 4 * GiB, "optimizer": 8 * GiB, "activations": 10 * GiB}
    for name in ("first_step", "steady_step"):
        trace["stages"][name]["phases"] = {"compute": [{"bytes": 22 * GiB, "breakdown": first}],
                                           "accumulating": [{"bytes": 26 * GiB, "breakdown": later}]}
    h100 = load_catalog()["H100-80GB"]
    one = estimate_fit(dict(trace, grad_accum_steps=8), h100, "fsdp", 8)      # one micro batch on each GPU
    two = estimate_fit(dict(trace, grad_accum_steps=16), h100, "fsdp", 8)     # two on each: the gradients held
    assert one["stages"]["steady_step"]["limiting_phase"] == "compute"
    assert two["stages"]["steady_step"]["limiting_phase"] == "accumulating"
    assert two["peak_allocated_bytes"] - one["peak_allocated_bytes"] == pytest.approx(4 * GiB / 8, rel=0.01)
    single = estimate_fit(dict(trace, grad_accum_steps=2), h100, "single", 1)
    assert single["stages"]["steady_step"]["limiting_phase"] == "accumulating"


@pytest.mark.process
def test_largest_micro_batch_is_confirmed_by_a_trace_at_that_batch(tmp_path):
    res = pilotrun_cli("select", str(SPEC), "--set", SHALLOW[0], "--set", AC, "--accelerator", "H100-80GB",
                       "--headroom", "0.05", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    row = json.loads(res.stdout)["rows"][0]
    assert row["activation_checkpointing"] and row["strategy"] == "single"
    largest = row["largest_micro_batch"]
    # Each example keeps at least its 4 layers' inputs (4 x 4096 x 4096 x 4 B fp32 residual = 256 MiB) and the
    # logits (4096 x 32000): tens of examples fit beside 17 GiB of state, never a thousand.
    assert 2 <= largest < 64, largest
    spec = load_spec(SPEC, [SHALLOW[0], AC], check_files=False)
    h100 = load_catalog()["H100-80GB"]
    budget = h100.memory_bytes * 0.95
    at = trace_in_subprocess(spec, ac=True, micro_batch=largest)
    over = trace_in_subprocess(spec, ac=True, micro_batch=largest + 1)
    assert at["stages"]["steady_step"]["batch_size"] == largest
    used_at = estimate_fit(at, h100, "single", 1)["device_used_bytes"]
    used_over = estimate_fit(over, h100, "single", 1)["device_used_bytes"]
    assert used_at <= budget < used_over, (used_at / GiB, budget / GiB, used_over / GiB)
