"""A torch.compile'd job in the estimate (estimate/compiled.py): what the min-cut partitioned graph saves for backward,
fused element-wise bytes, the row, the cache key and the plan's compile item."""
from __future__ import annotations

import pytest
import torch

from pilotrun.config import load_spec
from pilotrun.estimate import compiled as C
from pilotrun.estimate.cache import trace_key
from pilotrun.estimate.catalog import load_catalog
from pilotrun.estimate.model import estimate_fit
from pilotrun.estimate.plan import Assumptions, Item, pipeline_hours, recovery_item
from tests.conftest import EXAMPLES, REPO
from tests.estimate.test_estimate import synthetic_trace

GiB = 1 << 30
TINY = EXAMPLES / "tiny-sft" / "pilot.yaml"


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False)
    cfg._attn_implementation = "eager"   # attention as ordinary ops: the partitioner sees all of it
    return cfg, LlamaForCausalLM


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    # use_cache left on (its default), as a user's config has it: GPT-2 hands its block the cache positionally.
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    return cfg, GPT2LMHeadModel


@pytest.mark.parametrize(("family", "block_path"), [(_tiny_llama, "model.layers.0"), (_tiny_gpt2, "transformer.h.0")],
                         ids=["llama", "gpt2"])
def test_the_fake_partitioned_block_saves_what_the_real_compiled_block_saves_and_less_than_eager(family, block_path):
    """The estimator's count (fake tensors, aot_function with inductor's decompositions and the min-cut partitioner)
    against the real block compiled with torch.compile(backend="aot_eager_decomp_partition") -- the same partitioner
    and decompositions inductor runs -- whose saved tensors autograd's pack hook sees. Tolerance: 2% (measured:
    equal to the byte on torch 2.13, in fp32 too). Under bf16 autocast (the common job; fp32 runs the same code without
    the casts) the compiled graph saves the weights' bf16 casts, which the estimate counts as weight casts (as eager's
    autocast cache): the real count less the block's bf16 weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg, cls = family()
    torch.manual_seed(0)
    model = cls(cfg)
    block = model.get_submodule(block_path)
    ids = torch.randint(0, 128, (2, 16))
    args, kwargs = C.capture_block_inputs(model, block, lambda: model(input_ids=ids, labels=ids))
    # A key/value cache, by name or by position, is not handed on: each call would lengthen it (GPT-2's compiled
    # block then saw keys twice as long as its queries and was "not modelled").
    assert not any("Cache" in type(v).__name__ for v in (*args, *kwargs.values()))

    def under_autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    casts = sum(p.numel() * 2 for p in block.parameters() if p.dim() == 2)
    with under_autocast():
        eager_real = C.saved_bytes(block, args, kwargs)
        torch._dynamo.reset()
        try:
            compiled_real = C.saved_bytes(torch.compile(block, backend="aot_eager_decomp_partition"), args, kwargs,
                                          weight_casts=False) - casts
        finally:
            torch._dynamo.reset()
    with torch.device("meta"):
        fake_model = cls(cfg)
    with FakeTensorMode(allow_non_fake_inputs=True), under_autocast():
        fake_model = fake_model.to_empty(device="cpu")
        fake_block = fake_model.get_submodule(block_path)
        fa, fk = C.capture_block_inputs(fake_model, fake_block, lambda: fake_model(input_ids=ids, labels=ids))
        eager_fake = C.saved_bytes(fake_block, fa, fk)
        part = C.partitioned_block(fake_block, fa, fk)
        elementwise = C.eager_elementwise_bytes(fake_block, fa, fk)
    assert eager_fake == eager_real
    assert part["saved_bytes"] == pytest.approx(compiled_real, rel=0.02)
    assert part["saved_bytes"] < 0.9 * eager_fake
    # Fusion: connected element-wise ops as one kernel move less than each op on its own, recompute included.
    assert 0 < part["fused_pointwise_bytes"] < elementwise


def _compiled(trace: dict, layers: int = 32) -> dict:
    return {**trace, "compiled": {"scope": "blocks", "modelled": True, "block": "model.layers.0", "layers": layers,
                                  "eager_saved_bytes": 200 << 20, "compiled_saved_bytes": 150 << 20,
                                  "eager_pointwise_bytes": 400 << 20, "fused_pointwise_bytes": 100 << 20}}


def _with_ops(trace: dict) -> dict:
    # One micro batch: a matmul (compute-bound on an H100) and element-wise rows.
    ops = [["bf16", 10**13, 1 << 30, 32], ["bf16", 0, 1 << 30, 32], ["fp32", 0, 1 << 29, 10]]
    stages = {k: {**st, "ops": ops, "optimizer_ops": [["fp32", 0, 1 << 30, 1]]} for k, st in trace["stages"].items()}
    return {**trace, "stages": stages}


def test_the_compiled_row_takes_the_saved_bytes_off_the_activations_and_fused_bytes_off_element_wise_time():
    h100 = load_catalog()["H100-80GB"]
    eager = _with_ops(synthetic_trace())
    compiled = _compiled(eager)
    e, c = estimate_fit(eager, h100, "single", 1), estimate_fit(compiled, h100, "single", 1)
    less = 32 * (50 << 20)   # layers x (eager - compiled saved) per block
    assert e["stages"]["steady_step"]["peak_allocated_bytes"] - c["stages"]["steady_step"]["peak_allocated_bytes"] \
        == less
    row = next(n for n in c["notes"] if n["name"] == "torch.compile")
    assert row["bytes"] == -less
    assert row["reason"].startswith("compiled (blocks): saved activations from AOT autograd's min-cut partitioner")
    assert "pointwise chains fused" in row["reason"] and "matmul and attention time unchanged" in row["reason"]
    assert not any(n["name"] == "torch.compile" for n in e["notes"])
    # Element-wise time shrinks by the fused bytes; the matmuls' does not.
    assert c["time"]["memory_bound_seconds"] < e["time"]["memory_bound_seconds"]
    assert c["time"]["compute_seconds"] - c["time"]["memory_bound_seconds"] == pytest.approx(
        e["time"]["compute_seconds"] - e["time"]["memory_bound_seconds"])
    bw = h100.bandwidth_tb_s * 1e12 * h100.efficiencies().bandwidth
    # Every element-wise row is memory-bound: the time drops by the layers' fused bytes at the bandwidth.
    assert e["time"]["memory_bound_seconds"] - c["time"]["memory_bound_seconds"] == pytest.approx(
        32 * (300 << 20) / bw, rel=1e-6)


def test_activations_are_cut_in_full_only_where_every_layer_s_saved_bytes_are_held():
    full = C._less_activations({"activations": 10 * GiB, "gradients": 1}, eager=4 * GiB, saved=1 * GiB)
    later = C._less_activations({"activations": 2 * GiB}, eager=4 * GiB, saved=1 * GiB)
    assert full == {"activations": 9 * GiB, "gradients": 1}
    assert later == {"activations": 2 * GiB - GiB // 2}
    assert C.fused_ops([["bf16", 5, 100, 2], ["bf16", 0, 100, 2]], 100) == [["bf16", 5, 100, 2], ["bf16", 0, 50, 2]]
    assert C.compiled_trace(synthetic_trace()) == synthetic_trace()   # not compiled: as traced


def test_a_compiled_job_not_modelled_says_why_and_keeps_eager():
    trace = {**synthetic_trace(), "compiled": {"scope": "model", "modelled": False, "why": "with activation "
                                               "checkpointing the compiled graph's saved tensors are not modelled"}}
    fit = estimate_fit(trace, load_catalog()["H100-80GB"], "single", 1)
    row = next(n for n in fit["notes"] if n["name"] == "torch.compile")
    assert row["bytes"] == 0 and "not modelled" in row["reason"] and "activation checkpointing" in row["reason"]
    assert fit["peak_allocated_bytes"] == estimate_fit(synthetic_trace(), load_catalog()["H100-80GB"], "single",
                                                       1)["peak_allocated_bytes"]


def test_the_cache_key_differs_for_a_compiled_job():
    eager = load_spec(TINY, [], check_files=False)
    blocks = load_spec(TINY, ["train.compile=blocks"], check_files=False)
    model = load_spec(TINY, ["train.compile=model"], check_files=False)
    keys = [trace_key(s, "cuda", False, "fp32") for s in (eager, blocks, model)]
    assert keys[0] != keys[1] != keys[2] != keys[0]
    assert keys[0]["format"] >= 9


class _Ledger:
    def __init__(self, details: dict) -> None:
        self.details = details

    def runs(self, limit: int):
        return [{"run_id": "p1", "config_hash": self.hash, "kind": "pilot"}]

    def gate_records(self, run_id: str):
        from pilotrun.ledger.records import GateRow

        return [GateRow.from_mapping({"gate": "first_step", "verdict": "pass", "details": self.details, "seconds": 1.0})]


def test_the_plan_charges_the_measured_compile_once_per_start_and_says_unknown_otherwise():
    spec = load_spec(TINY, ["train.compile=blocks"], check_files=False)
    row = {"seconds_per_update": 1.0, "utilisation_source": "model", "gpus": 1, "price_per_gpu_hour": None,
           "accelerator": "H100-80GB"}
    trace = synthetic_trace()
    ledger = _Ledger({"compile_seconds": 90.0})
    ledger.hash = spec.pilot_hash()
    item = next(i for i in pipeline_hours(spec, row, trace, ledger)["items"] if i["item"] == Item.COMPILE)
    assert item["hours"] == pytest.approx(90 / 3600) and "measured by pilot p1" in item["from"]
    unknown = next(i for i in pipeline_hours(spec, row, trace)["items"] if i["item"] == Item.COMPILE)
    assert unknown["hours"] is None and "compile time: not measured (unknown)" in unknown["from"]
    eager = load_spec(TINY, [], check_files=False)
    assert not any(i["item"] == Item.COMPILE for i in pipeline_hours(eager, row, trace)["items"])
    # Each preemption restarts the process: it compiles again.
    a = Assumptions()
    assert recovery_item(24, None, a, 0.5)["hours"] - recovery_item(24, None, a)["hours"] == pytest.approx(0.5)


def test_the_published_compile_bench_keeps_its_sources_and_loads_its_job():
    import importlib.util

    loaded = importlib.util.spec_from_file_location("compile_published", REPO / "bench" / "compile_published.py")
    bench = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(bench)
    for pub in bench.PUBLISHED:
        assert pub["source"].startswith("https://github.com/pytorch/torchtitan/")
        assert pub["compiled_gib"] < pub["eager_gib"] and pub["compiled_tps"] > pub["eager_tps"]
    spec = load_spec(bench.SPEC, ["train.compile=blocks", "train.activation_checkpointing=selective-2"],
                     check_files=False)
    assert spec.train.compile == "blocks" and spec.model.config["num_hidden_layers"] == 32
