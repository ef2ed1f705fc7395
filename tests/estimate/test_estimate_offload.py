"""CPU offload (``distributed.offload: cpu``, FSDP2's CPUOffloadPolicy): the spec key, the strategy that honours it,
and what it does to the estimate (device bytes, host memory per node, PCIe and CPU-step time) and to the advisor."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from pilotrun import strategies
from pilotrun.config.load import load_spec
from pilotrun.config.schema import SpecError, build
from pilotrun.config.spec import Spec
from pilotrun.estimate import runner
from pilotrun.estimate.advise import Combination, combinations
from pilotrun.estimate.catalog import CatalogError, load_catalog
from pilotrun.estimate.model import estimate_fit, time_source
from pilotrun.estimate.trace import trace_job
from pilotrun.strategies import StageBytes
from tests.conftest import EXAMPLES, pilotrun_cli
from tests.estimate.test_estimate import GiB, synthetic_trace
from tests.estimate.test_estimate_time import _with_ops

MINIMAL = {"name": "v", "model": {"factory": "x:y"}, "data": {"factory": "x:y"},
           "train": {"micro_batch_size": 1, "grad_accum_steps": 1, "updates": 2,
                     "optimizer": {"name": "sgd", "lr": 0.1}}}
TINY = EXAMPLES / "tiny-sft" / "pilot.yaml"


def test_offload_is_a_key_of_the_distributed_section_and_needs_a_strategy_that_shards():
    assert build(Spec, MINIMAL).distributed.offload == "none"
    assert build(Spec, {**MINIMAL, "distributed": {"strategy": "fsdp", "offload": "cpu"}}).distributed.offload == "cpu"
    for strategy in ("single", "ddp"):
        with pytest.raises(SpecError) as info:
            build(Spec, {**MINIMAL, "distributed": {"strategy": strategy, "offload": "cpu"}})
        assert info.value.problems == [("distributed.offload", (
            f"cpu needs distributed.strategy fsdp (FSDP2's CPUOffloadPolicy), not {strategy!r}: set "
            "distributed.strategy: fsdp, or distributed.offload: none"))]
    with pytest.raises(SpecError) as info:
        build(Spec, {**MINIMAL, "distributed": {"strategy": "fsdp", "offload": "nvme"}})
    assert info.value.problems[0][0] == "distributed.offload"


@pytest.mark.process
def test_offload_beside_a_strategy_that_cannot_is_exit_2_naming_the_field(tmp_path):
    res = pilotrun_cli("estimate", str(TINY), "--set", "distributed.offload=cpu", "--json", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "distributed.offload" in res.stderr and "distributed.strategy: fsdp" in res.stderr


def test_the_registry_offloads_only_a_configured_copy_and_one_process_refuses_it():
    fsdp = strategies.for_processes("fsdp", 2, "cpu")
    assert fsdp.offload == "cpu" and strategies.get("fsdp").offload == "none"  # the registry's object untouched
    assert strategies.for_processes("fsdp", 2).offload == "none"
    with pytest.raises(strategies.ProcessMismatch, match="1 process run 'single'.*distributed.offload: none"):
        strategies.for_processes("fsdp", 1, "cpu")
    with pytest.raises(ValueError, match="cannot offload"):
        strategies.get("ddp").configured("cpu")


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def test_fsdp2_offload_runs_on_cpu_where_it_moves_nothing_and_trains_alike(tmp_path):
    """On a CPU device the shards are host memory already: the policy is applied (unpinned: pin_memory needs an
    accelerator) and an update with clipping and AdamW lands on the same parameters as without offload."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy

    from pilotrun.distributed import DistEnv

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        results = []
        for offload in ("none", "cpu"):
            torch.manual_seed(0)
            model = _Blocks()
            chosen = strategies.get("fsdp").configured(offload)
            done = chosen.wrap(model, DistEnv(0, 0, 1, "fsdp"), torch.device("cpu"))
            wrapped: Any = done[0]   # fully_shard's FSDPModule: its parameters are DTensors
            how = done[1]
            policy = wrapped.blocks[0]._get_fsdp_state()._fsdp_param_group.offload_policy
            assert isinstance(policy, CPUOffloadPolicy) == (offload == "cpu")
            assert ("CPU offload" in how) == (offload == "cpu")
            opt = torch.optim.AdamW(wrapped.parameters(), lr=0.1)
            wrapped(torch.ones(3, 4)).sum().backward()
            norm = chosen.clip_gradients(wrapped.parameters(), 0.5)
            chosen.optimizer_step(opt)
            results.append((norm, [p.full_tensor().clone() for p in wrapped.parameters()]))
        (norm_off, plain), (norm_on, offloaded) = results
        assert not policy.pin_memory and "nothing moves" in how
        assert norm_on == pytest.approx(norm_off)
        assert all(torch.equal(a, b) for a, b in zip(plain, offloaded, strict=True))
    finally:
        dist.destroy_process_group()


def test_offloaded_state_leaves_the_device_and_is_counted_on_the_host():
    trace = synthetic_trace(params=4 * GiB, acts=10 * GiB, opt=8 * GiB)
    stage = StageBytes(parameters=4 * GiB, gradients=4 * GiB, optimizer=8 * GiB, buffers=0, activations=10 * GiB,
                       weight_casts=0)
    plain = strategies.get("fsdp")
    offloaded = plain.configured("cpu")
    on_device, _ = plain.estimate_memory(stage, trace, 8, True)
    off_device, corrections = offloaded.estimate_memory(stage, trace, 8, True)
    layer = trace["largest_layer_bytes"]
    # The 2 GiB shard per rank leaves; one layer's parameter shard and one gradient shard stay in flight.
    assert on_device - off_device == pytest.approx(16 * GiB / 8 - 2 * layer / 8)
    offload = next(c for c in corrections if c["name"] == "FSDP2 CPU offload")
    assert offload["bytes"] == int(2 * layer / 8 - 2 * GiB)
    assert offloaded.host_bytes(trace, 8) == 2 * GiB and plain.host_bytes(trace, 8) == 0
    # Evaluation copies parameter shards in only, and holds no unsharded gradient.
    assert offloaded.estimate_memory(stage, trace, 8, False)[0] == pytest.approx(off_device - layer / 8 - layer)


def test_a_quantised_base_s_state_stays_whole_on_every_rank_sharded_or_offloaded():
    """bitsandbytes' absmax and codes are attributes, not parameters: FSDP shards and offloads only the packed
    weights, so every rank holds the whole state beside its shard."""
    q = GiB // 2
    trace = {**synthetic_trace(params=4 * GiB, acts=10 * GiB, opt=8 * GiB),
             "adaptation": {"quant_state_bytes": q}}
    bare = {k: v for k, v in trace.items() if k != "adaptation"}
    stage = StageBytes(parameters=4 * GiB, gradients=4 * GiB, optimizer=8 * GiB, buffers=0, activations=10 * GiB,
                       weight_casts=0)
    for chosen, kept in ((strategies.get("fsdp"), q - q / 8), (strategies.get("fsdp").configured("cpu"), q)):
        with_state, corrections = chosen.estimate_memory(stage, trace, 8, True)
        assert with_state - chosen.estimate_memory(stage, bare, 8, True)[0] == pytest.approx(kept)
        row = next(c for c in corrections if c["name"] == "quantisation state on every rank")
        assert row["bytes"] == int(kept) and "not parameters" in row["reason"]
    offloaded = strategies.get("fsdp").configured("cpu")
    assert offloaded.host_bytes(bare, 8) - offloaded.host_bytes(trace, 8) == pytest.approx(q / 8)
    assert not any(c["name"] == "quantisation state on every rank"
                   for c in strategies.get("fsdp").estimate_memory(stage, bare, 8, True)[1])
    # FSDP on one GPU without offload holds all of it anyway: no row.
    assert not any(c["name"] == "quantisation state on every rank"
                   for c in strategies.get("fsdp").estimate_memory(stage, trace, 1, True)[1])


def test_the_row_reports_host_memory_per_node_and_checks_it_where_the_node_is_known():
    h100 = load_catalog()["H100-80GB"]
    trace = synthetic_trace(params=4 * GiB, acts=10 * GiB, opt=8 * GiB)
    plain = estimate_fit(trace, h100, "fsdp", 16)
    row = estimate_fit({**trace, "offload": "cpu"}, h100, "fsdp", 16)
    assert row["offload"] == "cpu" and plain["offload"] == "none" and plain["host_memory"] is None
    assert row["device_used_bytes"] < plain["device_used_bytes"]
    # 16 ranks, 8 on a node, each with 1/16 of 16 GiB.
    assert row["host_bytes_per_node"] == 8 * GiB and row["host_memory"]["ranks_per_node"] == 8
    assert "host memory of the node unknown" in row["host_memory"]["note"] and row["fits"]
    small = dataclasses.replace(h100, host={**h100.host, "memory_gb": 4})
    assert estimate_fit(trace, small, "fsdp", 16, offload="cpu")["fits"] is False
    assert "more than the node's" in estimate_fit(trace, small, "fsdp", 16, offload="cpu")["host_memory"]["note"]
    # A strategy that cannot offload is estimated as it is, and its row says the spec's offload was not applied.
    ddp = estimate_fit({**trace, "offload": "cpu"}, h100, "ddp", 8)
    assert ddp["host_bytes_per_node"] == 0
    assert any("not applied" in n["reason"] for n in ddp["notes"] if n["name"] == "CPU offload")


def test_offload_time_adds_the_copies_it_cannot_hide_and_the_cpu_step():
    h100 = load_catalog()["H100-80GB"]
    layers, gpus = 32, 8
    # Compute far larger than any copy: only what nothing computes beside is exposed.
    trace = _with_ops(synthetic_trace(), micro=[["bf16", int(1e16), int(1e9), 10]], step=[["fp32", 0, int(5e10), 1]],
                      accum=gpus)
    layer, params, grads = trace["largest_layer_bytes"], trace["parameter_bytes"], trace["gradient_bytes"]
    root = params - layer * layers
    link = 64e9
    plain = estimate_fit(trace, h100, "fsdp", gpus)
    row = estimate_fit(trace, h100, "fsdp", gpus, offload="cpu")
    off = row["time"]["offload"]
    assert off["pcie_seconds"] == pytest.approx((2 * layer * layers + root + grads) / gpus / link)
    # One micro batch per GPU: the root's copy-in, the first block's in forward and in backward, the last gradient
    # shards out (block and root).
    assert off["exposed_pcie_seconds"] == pytest.approx((root + 2 * layer + layer + root) / gpus / link)
    assert off["cpu_step_seconds"] is None and off["lower_bound"]
    gpu_step = plain["time"]["optimizer_seconds"]
    assert off["gpu_step_seconds_removed"] == pytest.approx(gpu_step)
    assert row["seconds_per_update"] == pytest.approx(plain["seconds_per_update"] - gpu_step
                                                      + off["exposed_pcie_seconds"])
    assert "host.memory_bandwidth_gb_s" in time_source(row["time"]) and "lower bound" in time_source(row["time"])
    # With the node's memory bandwidth: AdamW's 3 x gradient + 2 x state bytes per shard, 8 ranks at once.
    node = dataclasses.replace(h100, host={**h100.host, "memory_bandwidth_gb_s": 800})
    known = estimate_fit(trace, node, "fsdp", gpus, offload="cpu")
    step = (3 * grads + 2 * trace["optimizer_state_bytes"]) / gpus * 8 / 800e9
    assert known["time"]["offload"]["cpu_step_seconds"] == pytest.approx(step)
    assert known["seconds_per_update"] == pytest.approx(row["seconds_per_update"] + step, rel=1e-9)
    # 8 GPUs copying at once share the node's memory: 200 GB/s leaves each 25 GB/s, below its 64 GB/s link.
    slow = dataclasses.replace(h100, host={**h100.host, "memory_bandwidth_gb_s": 200})
    assert estimate_fit(trace, slow, "fsdp", gpus, offload="cpu")["time"]["offload"]["host_link_gb_s"] == 25
    # No host link in the catalog: no time, and the reason names the key.
    a10g = load_catalog()["A10G-24GB"]
    assert "host.link_gb_s" in (estimate_fit(trace, dataclasses.replace(a10g, peak_tflops=h100.peak_tflops),
                                             "fsdp", gpus, offload="cpu")["time"]["reason"])


def test_later_micro_batches_copy_their_gradients_synchronously():
    h100 = load_catalog()["H100-80GB"]
    trace = _with_ops(synthetic_trace(), micro=[["bf16", int(1e16), int(1e9), 10]], step=[], accum=16)
    layer, params, grads = trace["largest_layer_bytes"], trace["parameter_bytes"], trace["gradient_bytes"]
    root = params - layer * 32
    off = estimate_fit(trace, h100, "fsdp", 8, offload="cpu")["time"]["offload"]   # 2 micro batches per GPU
    first = (root + 2 * layer + layer + root) / 8 / 64e9
    later = (root + 2 * layer) / 8 / 64e9 + grads / 8 / 64e9
    assert off["exposed_pcie_seconds"] == pytest.approx(first + later)


@pytest.fixture(scope="module")
def tiny_offload():
    """The demo as an FSDP2 job with offload, traced once (a few seconds) as estimate's Traces serves it."""
    spec = load_spec(TINY, overrides=["distributed.strategy=fsdp", "distributed.offload=cpu"], check_files=False)
    trace = trace_job(spec, target="cuda").to_dict()
    return spec, trace


def test_an_fsdp_spec_with_offload_uses_less_gpu_memory_more_host_memory_and_more_time(tiny_offload, monkeypatch):
    spec, traced = tiny_offload
    monkeypatch.setattr(runner, "trace_in_subprocess", lambda *a, **k: traced)
    trace = runner.Traces(spec).get()
    assert trace["offload"] == "cpu" and "offload" not in traced  # the job's choice, never in the cached trace
    h100 = load_catalog()["H100-80GB"]
    on = estimate_fit(trace, h100, "fsdp", 8)
    off = estimate_fit(trace, h100, "fsdp", 8, offload="none")
    assert on["device_used_bytes"] < off["device_used_bytes"]
    assert on["host_bytes_per_node"] == (traced["parameter_bytes"] + traced["gradient_bytes"]
                                         + traced["optimizer_state_bytes"]) and off["host_bytes_per_node"] == 0
    assert on["seconds_per_update"] > off["seconds_per_update"]
    assert any(c["name"] == "FSDP2 CPU offload" for c in on["stages"][on["limiting_stage"]]["corrections"])


def test_the_advisor_offloads_only_once_nothing_on_one_node_fits(tiny_offload):
    spec, _ = tiny_offload
    cat = load_catalog()
    h100, h200 = cat["H100-80GB"], cat["H200-141GB"]
    order = sorted([Combination(h100, gpus=16, shard_level=4), Combination(h100, gpus=8, shard_level=3, offload=True),
                    Combination(h100, gpus=8, shard_level=3, checkpointing="full"),
                    Combination(h200, accelerator_level=1), Combination(h100, gpus=2, shard_level=1, offload=True)],
                   key=lambda c: c.cost)
    assert [(c.gpus, c.offload, c.accelerator.name) for c in order] == [
        (8, False, "H100-80GB"), (2, True, "H100-80GB"), (8, True, "H100-80GB"), (16, False, "H100-80GB"),
        (1, False, "H200-141GB")]
    plain = load_spec(TINY, check_files=False)   # single: offload only with the sharding fix, over 2+ GPUs
    found = combinations(plain, h100, "single", 1, {"H100-80GB": h100})
    offloading = [c for c in found if c.offload]
    assert offloading and all(c.shard_level and c.gpus > 1 for c in offloading)
    assert "CPU offload" in offloading[0].name()
    assert not any(c.offload for c in combinations(spec, h100, "fsdp", 2, {"H100-80GB": h100}))  # already offloads


def test_the_catalog_host_figures_are_checked():
    cat = load_catalog()
    assert cat["H100-80GB"].host_figure("link_gb_s") == 64 and cat["A100-80GB"].host_figure("link_gb_s") == 32
    assert cat["A10G-24GB"].host_figure("link_gb_s") is None and cat["H100-80GB"].host_figure("memory_gb") is None


def test_a_bad_host_mapping_in_a_user_catalog_names_the_key(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("accelerators:\n  H100-80GB:\n    host: {link_gb: 64}\n")
    with pytest.raises(CatalogError, match="host has unknown key"):
        load_catalog(bad)
    bad.write_text("accelerators:\n  H100-80GB:\n    host: {memory_gb: -1}\n")
    with pytest.raises(CatalogError, match="host.memory_gb must be a positive number"):
        load_catalog(bad)
