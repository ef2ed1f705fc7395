"""Plans beyond one node: the sheet shards over whole nodes of the catalog's gpus_per_node once one node cannot hold
the job, stops at the smallest cluster that fits (or says how far it looked), and times the collectives at the link
between nodes, the rental's figure (--inter-node-gb-s) or the catalog's, said as a lower bound when neither is known.

Pure: synthetic traces of a Llama-2-70B-sized full fine-tune (fp32 master weights and gradients, AdamW's two moments)
on the built-in catalog; the real 70B trace is `pilotrun select examples/llama-70b-estimate/pilot.yaml` (minutes)."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pilotrun.cli.select import gpus_cell, inter_node_notes
from pilotrun.estimate.catalog import load_catalog
from pilotrun.estimate.model import estimate_fit
from pilotrun.estimate.select import MAX_NODES, choose, config_label, gpu_counts, inter_node, with_inter_node
from tests.estimate.test_estimate import synthetic_trace

GB = 10**9
GiB = 2**30
PARAMS_70B = 69 * 10**9


class FakeTraces:
    """What choose() asks of estimate.runner.Traces: the trace without and with activation checkpointing."""

    def __init__(self, trace: dict, checkpointed: dict) -> None:
        self.by_ac = {False: trace, True: checkpointed}

    def get(self, ac=None, precision=None) -> dict:
        return self.by_ac[bool(ac)]


def _seventy_b(acts: int = 40 * GiB) -> FakeTraces:
    params = 4 * PARAMS_70B  # fp32 master weights (bf16 autocast); gradients as many; AdamW 2 x 4 B a parameter
    full = dict(synthetic_trace(params=params, acts=acts, opt=2 * params), grad_accum_steps=16)
    ckpt = dict(synthetic_trace(params=params, acts=acts // 8, opt=2 * params), grad_accum_steps=16,
                activation_checkpointing=True)
    return FakeTraces(full, ckpt)


SPEC = SimpleNamespace(train=SimpleNamespace(activation_checkpointing=False, micro_batch_size=1, grad_accum_steps=16))


def test_the_counts_tried_go_node_by_node_up_to_max_nodes():
    h100 = load_catalog()["H100-80GB"]
    assert gpu_counts(h100) == [2, 4, 8, 16, 32, 64, 128]
    four = replace(h100, interconnect={**h100.interconnect, "gpus_per_node": 4})
    assert gpu_counts(four) == [2, 4, 8, 16, 32, 64]  # 16 nodes of 4 at most
    assert max(gpu_counts(four)) == MAX_NODES * 4
    assert config_label("fsdp", 16, 8, ac=True) == "fsdp x16 (2 nodes x 8) + activation checkpointing"
    assert config_label("fsdp", 8, 8) == "fsdp x8" and config_label("single", 1, 8) == "single"
    assert gpus_cell({"gpus": 16, "nodes": 2}) == "16 = 2 x 8" and gpus_cell({"gpus": 8, "nodes": 1}) == "8"


def test_a_70b_full_fine_tune_on_h100s_is_planned_on_the_smallest_cluster_of_nodes_that_fits():
    h100 = load_catalog()["H100-80GB"]
    traces = _seventy_b()
    trace, fit, steps = choose(SPEC, traces, h100, 0.05)
    assert fit["gpus"] > 8 and fit["gpus"] % 8 == 0, steps  # one node of eight cannot hold 1.1 TB of state
    assert "fsdp x8 + activation checkpointing: does not fit" in "\n".join(steps)
    assert steps[-1].startswith(f"fsdp x{fit['gpus']} ({fit['gpus'] // 8} nodes x 8)") and "fits" in steps[-1]
    # the smallest: half as many nodes does not fit, with checkpointing or without
    smaller = estimate_fit(traces.get(ac=True), h100, "fsdp", fit["gpus"] // 2)
    assert smaller["device_used_bytes"] > h100.memory_bytes * 0.95


def test_a_job_no_cluster_tried_holds_says_how_far_the_sheet_looked():
    h100 = load_catalog()["H100-80GB"]
    huge = _seventy_b(acts=400 * GiB)  # activations alone larger than a device, checkpointed or not
    _, fit, steps = choose(SPEC, huge, h100, 0.05)
    assert not fit["fits"] or fit["device_used_bytes"] > h100.memory_bytes * 0.95
    assert steps[-1] == (f"nothing larger is tried: at most {MAX_NODES} nodes of 8 ({MAX_NODES * 8} GPUs) sharded with "
                         "FSDP; beyond that the job needs tensor or pipeline parallelism, not modelled")
    assert "fsdp x128 (16 nodes x 8) + activation checkpointing: does not fit" in steps[-2]


def test_collectives_across_nodes_run_at_the_rentals_link_or_are_a_lower_bound():
    h100 = load_catalog()["H100-80GB"]
    trace = _seventy_b().get(ac=True)
    unknown = inter_node(h100)
    assert unknown["gb_s"] is None and unknown["lower_bound"] and "lower bound" in unknown["from"]
    rented = with_inter_node(h100, 50.0, "--inter-node-gb-s 50")
    assert inter_node(rented) == {"gb_s": 50.0, "lower_bound": False, "from": "--inter-node-gb-s 50"}
    assert h100.interconnect.get("inter_node_gb_s") is None  # the catalog's entry is left as it was
    lower = estimate_fit(trace, h100, "fsdp", 32)["time"]
    slow = estimate_fit(trace, rented, "fsdp", 32)["time"]
    assert lower["communication"]["lower_bound"] and not slow["communication"]["lower_bound"]
    assert "across 4 nodes at 50 GB/s per GPU" in slow["communication"]["link"]
    assert slow["communication_seconds"] == pytest.approx(lower["communication_seconds"] * 900 / 50)
    row = {"accelerator": "H100-80GB", "fits": True, "gpus": 32, "nodes": 4, "inter_node": inter_node(rented)}
    assert inter_node_notes([row, dict(row, fits=False)]) == [
        "H100-80GB: 4 nodes x 8 GPUs; between nodes 50 GB/s per GPU (--inter-node-gb-s 50)"]
