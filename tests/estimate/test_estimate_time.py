"""The time model: each traced op's FLOPs and bytes, and its time as the larger of the two on an accelerator."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pilotrun.config import load_spec
from pilotrun.estimate.catalog import load_catalog
from pilotrun.estimate.model import estimate_fit, seconds_per_update, time_source
from pilotrun.estimate.ops import OpCosts, roofline_seconds
from pilotrun.estimate.trace import trace_job
from tests.conftest import EXAMPLES
from tests.estimate.test_estimate import synthetic_trace

F32 = 4


def test_each_op_counts_its_flops_and_the_bytes_it_reads_and_writes():
    x, w, b = torch.randn(8, 16), torch.randn(16, 32), torch.randn(8, 32)
    with OpCosts() as costs:
        y = x @ w                 # mm: reads x and w, writes y
        y.t()                     # a view: moves nothing
        y.add_(b)                 # in place: reads y and b, writes y back
        z = y * y                 # the same input twice is read once
    rows = {(flops, moved): n for _, flops, moved, n in costs.rows()}
    assert rows.pop((2 * 8 * 16 * 32, (8 * 16 + 16 * 32 + 8 * 32) * F32)) == 1
    assert rows.pop((0, 3 * 8 * 32 * F32)) == 1      # add_: y and b read, y written
    assert rows.pop((0, 2 * 8 * 32 * F32)) == 1      # y * y: y read once, z written
    assert rows == {}
    assert z.shape == (8, 32)


def test_out_arguments_are_writes_and_a_kernel_the_device_runs_whole_stays_one_op():
    x, y, v = torch.randn(8, 8), torch.randn(8, 8), torch.empty(8, 8)
    i = torch.empty(8, 8, dtype=torch.long)
    h = torch.randn(4, 8, requires_grad=True)
    with OpCosts() as costs:
        torch.mul(x, y, out=x)        # reads x and y, writes x
        torch.sort(y, out=(v, i))     # reads y, writes values and indices
        torch.nn.functional.silu(h).sum().backward()
    moved = [b for _, _, b, _ in costs.rows()]
    assert 3 * 64 * F32 in moved and (64 * F32 + 64 * F32 + 64 * 8) in moved
    # silu_backward reads the gradient and the input and writes one tensor: one op of 3 x 32 floats, not the seven
    # element-wise ops of its generic decomposition.
    assert [b for b in moved if b == 3 * 32 * F32] and not any(r[2] == 0 for r in costs.rows())


def test_an_op_is_as_slow_as_the_larger_of_its_flops_and_its_bytes():
    acc = dataclasses.replace(load_catalog()["A100-80GB"], bandwidth_tb_s=2.0)
    rows = [["bf16", 312e12, 1e9, 1],      # 1 s of FLOPs at the full peak, 0.5 ms of bytes: compute-bound
            ["fp32", 0, 2e12, 3],          # 1 s each of bytes at 2 TB/s: memory-bound, three times
            ["fp32", 19.5e12, 0, 2]]       # fp32 matmuls run at the fp32 peak (TF32 is off for matmuls)
    t = roofline_seconds(rows, acc, compute_efficiency=1.0, bandwidth_efficiency=1.0)
    assert t["compute_bound_seconds"] == pytest.approx(1 + 2)
    assert t["memory_bound_seconds"] == pytest.approx(3)
    assert t["seconds"] == pytest.approx(6) and t["bytes"] == 1e9 + 6e12
    half = roofline_seconds(rows, acc, compute_efficiency=0.5, bandwidth_efficiency=0.5)
    assert half["seconds"] == pytest.approx(12)
    no_fp8 = dataclasses.replace(acc, peak_tflops={**acc.peak_tflops, "fp8": None})
    assert roofline_seconds([["fp8", 1e12, 0, 1]], no_fp8, 0.7, 0.8) == {
        "seconds": None, "reason": "A100-80GB has no fp8 peak in the catalog"}


def _with_ops(trace: dict, micro: list, step: list, accum: int = 4) -> dict:
    st = dict(trace["stages"]["steady_step"], ops=micro, optimizer_ops=step)
    return dict(trace, stages=dict(trace["stages"], steady_step=st), grad_accum_steps=accum)


def test_micro_batches_split_over_the_gpus_and_only_a_sharded_optimizer_step_does():
    acc = load_catalog()["H100-80GB"]
    eff = acc.efficiencies()
    trace = _with_ops(synthetic_trace(), micro=[["bf16", int(1e14), int(1e9), 10]], step=[["fp32", 0, int(5e10), 1]])
    micro_s = 10 * 1e14 / (989e12 * eff.compute)
    step_s = 5e10 / (acc.bandwidth_tb_s * 1e12 * eff.bandwidth)
    single = seconds_per_update(trace, acc, "single", 1, "bf16")
    assert single["model"] == "roofline"
    assert single["compute_seconds"] == pytest.approx(4 * micro_s + step_s)
    assert single["optimizer_seconds"] == pytest.approx(step_s) and single["bound"] == "compute"
    ddp = seconds_per_update(trace, acc, "ddp", 4, "bf16")
    assert ddp["compute_seconds"] == pytest.approx(micro_s + step_s)       # every rank steps every parameter
    fsdp = seconds_per_update(trace, acc, "fsdp", 4, "bf16")
    assert fsdp["compute_seconds"] == pytest.approx(micro_s + step_s / 4)  # each rank steps its shard
    assert fsdp["memory_bound_seconds"] == pytest.approx(step_s / 4)
    assert "memory-bound" in time_source(fsdp)
    # A pilot's measured utilisation gives back the time it measured: FLOPs over the peak x that share.
    measured = seconds_per_update(trace, acc, "single", 1, "bf16", utilisation=0.5)
    assert measured["model"] == "flops" and measured["compute_seconds"] == pytest.approx(1e15 / (989e12 * 0.5))
    assert time_source(measured, "measured by pilot r1") == (
        "measured by pilot r1; scaled by FLOPs from the pilot's configuration to this one")


def test_each_gpu_runs_whole_micro_batches_and_a_smaller_one_keeps_the_examples():
    acc = load_catalog()["H100-80GB"]
    trace = _with_ops(synthetic_trace(), micro=[["bf16", int(1e14), int(1e9), 10]], step=[], accum=4)
    one = seconds_per_update(trace, acc, "single", 1, "bf16")["compute_seconds"]
    # 4 micro batches over 8 GPUs: each GPU still runs one whole micro batch, never half of one.
    eight = seconds_per_update(trace, acc, "ddp", 8, "bf16")
    assert eight["micro_batches_per_gpu"] == 1 and eight["compute_seconds"] == pytest.approx(one / 4)
    # Half the micro batch on one GPU: twice the micro batches at half the cost each (the costs scale linearly).
    half = seconds_per_update(trace, acc, "single", 1, "bf16", micro_scale=0.5)
    assert half["micro_batches_per_gpu"] == 8 and half["compute_seconds"] == pytest.approx(one)
    # 3 micro batches over 2 GPUs: 2 each, whole ones (the time of 4 traced micro batches' work in all).
    three = _with_ops(synthetic_trace(), micro=[["bf16", int(1e14), int(1e9), 10]], step=[], accum=3)
    two = seconds_per_update(three, acc, "ddp", 2, "bf16")
    assert two["micro_batches_per_gpu"] == 2 and two["compute_seconds"] == pytest.approx(one / 4 * 2)


def test_fsdp_gathers_once_per_micro_batch_each_gpu_runs():
    acc = load_catalog()["H100-80GB"]
    trace = _with_ops(synthetic_trace(), micro=[["bf16", int(1e12), int(1e9), 1]], step=[], accum=4)
    comm = [seconds_per_update(trace, acc, "fsdp", 4, "bf16", micro_scale=s)["communication_seconds"]
            for s in (1.0, 0.5, 0.25)]
    assert comm[1] == pytest.approx(2 * comm[0]) and comm[2] == pytest.approx(4 * comm[0])


def test_fsdp_hides_its_gathers_behind_the_blocks_compute_and_adds_only_what_shows():
    """Issue 42: FSDP2 prefetches the next block's all-gather while a block computes. With ample compute per block
    the update waits only for the first gathers and the last reduce-scatters; with none, for all of it; DDP's
    all-reduce is added whole (not modelled as overlapped), and every row says its model."""
    from pilotrun import strategies

    fsdp, ddp = strategies.get("fsdp"), strategies.get("ddp")
    trace = synthetic_trace()   # 32 blocks of 128 MiB, a 4 GiB model, bf16
    bw = 100e9
    total = fsdp.communication_seconds(trace, 8, "bf16", bw, 1)
    hidden, how = fsdp.exposed_communication(total, trace, 8, "bf16", bw, 1, compute_seconds=10.0)
    bare, _ = fsdp.exposed_communication(total, trace, 8, "bf16", bw, 1, compute_seconds=0.0)
    assert bare == pytest.approx(total)   # nothing to hide behind
    wire = 7 / 8 / bw
    layer = trace["largest_layer_bytes"]   # 32 of them hold every parameter: the root gathers nothing
    edges = (2 * layer * 0.5 + layer) * wire   # the first bf16 gathers (forward, backward) and the last fp32 scatter
    assert hidden == pytest.approx(edges) and hidden < total / 10
    assert "overlapped as FSDP2 prefetches" in how and f"{hidden / total:.0%}" in how
    assert ddp.exposed_communication(1.0, trace, 8, "bf16", bw, 1, 10.0) == (
        1.0, "not overlapped with compute (an upper bound)")
    acc = load_catalog()["H100-80GB"]
    busy = _with_ops(trace, micro=[["bf16", int(1e15), 0, 1]], step=[], accum=8)
    t = seconds_per_update(busy, acc, "fsdp", 8, "bf16")
    assert t["seconds"] == pytest.approx(t["compute_seconds"] + t["exposed_communication_seconds"])
    assert t["exposed_communication_seconds"] < t["communication_seconds"]


def test_the_bound_is_communication_only_when_it_outlasts_the_compute():
    acc = load_catalog()["H100-80GB"]
    eff = acc.efficiencies()
    # 3 ms of FLOPs and 3 ms of bytes per update: compute 6 ms; FSDP's gathers of the 4 GiB model (about 4.8 ms)
    # take longer than either part but not than both together: the bound is the update's own work, not the network.
    flops = int(0.003 * 989e12 * eff.compute)
    moved = int(0.003 * acc.bandwidth_tb_s * 1e12 * eff.bandwidth)
    trace = _with_ops(synthetic_trace(), micro=[["bf16", flops, 0, 1], ["bf16", 0, moved, 1]], step=[], accum=1)
    t = seconds_per_update(trace, acc, "fsdp", 2, "bf16")
    assert t["compute_seconds"] == pytest.approx(0.006)
    assert 0.003 < t["communication_seconds"] < 0.006, t["communication_seconds"]
    assert t["bound"] in ("compute", "memory")


def test_a_trace_written_before_per_op_costs_is_timed_by_flops_and_says_so():
    acc = load_catalog()["H100-80GB"]
    t = seconds_per_update(synthetic_trace(), acc, "single", 1, "bf16")
    assert t["model"] == "flops" and t["utilisation"] == 0.4
    assert time_source(t) == "40% of the dense peak (catalog default; the trace has no per-op costs)"


def test_a_catalog_entry_may_carry_its_own_efficiencies_with_their_source(tmp_path):
    user = tmp_path / "cat.yaml"
    user.write_text("accelerators:\n  H100-80GB:\n    efficiency: {compute: 0.5, bandwidth: 0.9, source: my bench}\n")
    own = load_catalog(user)["H100-80GB"].efficiencies()
    assert (own.compute, own.bandwidth, own.source) == (0.5, 0.9, "my bench")
    default = load_catalog()["L4-24GB"].efficiencies()   # no measured matmul rate: the flat defaults
    assert (default.compute, default.bandwidth) == (0.7, 0.8) and "default efficiencies" in default.source


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_demo_trace_counts_the_optimizer_step_and_the_matmuls_in_their_dtype(precision):
    """AdamW reads parameter, gradient and both moments and writes parameter and moments: at least 7 x the fp32
    parameter bytes per step, whatever its temporaries; under bf16 autocast the matmuls run in bf16."""
    spec = load_spec(EXAMPLES / "tiny-sft" / "pilot.yaml", overrides=[f"train.precision={precision}"],
                     check_files=False)
    trace = trace_job(spec, target="cuda").to_dict()
    step = trace["stages"]["steady_step"]
    step_bytes = sum(b * n for _, _, b, n in step["optimizer_ops"])
    assert step_bytes >= 7 * trace["parameter_bytes"]
    assert sum(f * n for _, f, _, n in step["ops"]) * trace["grad_accum_steps"] == step["flops"]
    matmul_dtypes = {d for d, f, _, _ in step["ops"] if f}
    assert matmul_dtypes == {precision}
    fit = estimate_fit(trace, load_catalog()["H100-80GB"], "single", 1)
    # The demo's matmuls are too small to keep an H100 busy: most of its update waits on memory.
    assert fit["time"]["model"] == "roofline" and fit["time"]["bound"] == "memory"
    assert fit["seconds_per_update"] / 2 < fit["time"]["memory_bound_seconds"] <= fit["seconds_per_update"]


def test_across_nodes_the_collectives_run_at_the_link_between_nodes_or_the_time_says_it_is_a_lower_bound(tmp_path):
    trace = _with_ops(synthetic_trace(), micro=[["bf16", int(1e14), int(1e9), 10]], step=[], accum=16)
    built_in = load_catalog()["H100-80GB"]
    one_node = seconds_per_update(trace, built_in, "fsdp", 8, "bf16")
    assert one_node["communication"] == {"link": "within one node at 900 GB/s per GPU", "lower_bound": False}
    two_nodes = seconds_per_update(trace, built_in, "fsdp", 16, "bf16")
    assert two_nodes["communication"]["lower_bound"] and "lower bound" in time_source(two_nodes)
    user = tmp_path / "cat.yaml"
    user.write_text("accelerators:\n  H100-80GB:\n    interconnect: {kind: NVLink4 + IB, per_gpu_gb_s: 900, "
                    "gpus_per_node: 8, inter_node_gb_s: 50}\n")
    told = seconds_per_update(trace, load_catalog(user)["H100-80GB"], "fsdp", 16, "bf16")
    assert told["communication"] == {"link": "across 2 nodes at 50 GB/s per GPU", "lower_bound": False}
    assert told["communication_seconds"] == pytest.approx(two_nodes["communication_seconds"] * 900 / 50)
    assert "lower bound" not in time_source(told)
