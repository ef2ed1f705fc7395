"""bench/published_memory.py and bench/published_time.py compare the estimate with published GPU measurements; their
specs must keep loading and keep describing the published jobs (the comparisons trace 1B-13B models: `make bench`,
not CI)."""
from __future__ import annotations

import importlib.util

import yaml

from pilotrun import strategies
from pilotrun.config import load_spec
from pilotrun.estimate.catalog import find, load_catalog
from tests.conftest import REPO

PEFT_SPEC = "llama2-70b-qlora-fsdp-offload.yaml"


def _bench():
    spec = importlib.util.spec_from_file_location("published_memory", REPO / "bench" / "published_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_published_jobs_specs_load_and_say_what_was_measured():
    bench = _bench()
    assert {r["spec"] for r in bench.RUNS} == {"mistral-7b-lora.yaml", "mistral-7b-qlora.yaml", "mistral-7b-full.yaml",
                                               "llama2-70b-qlora-fms.yaml", "mixtral-8x7b-lora-fms.yaml",
                                               "llama3-8b.yaml", PEFT_SPEC}
    for run in bench.RUNS:
        # "unknown" only where the source names no counter (the PEFT guide's rows): compared, not counted.
        assert run["counter"] in ("allocated", "reserved", "unknown") and run["source"].startswith("https://")
        assert (run["counter"] == "unknown") == (run["spec"] == PEFT_SPEC), run["job"]
        catalog = load_catalog(bench.SPECS / run["catalog"]) if run.get("catalog") else load_catalog()
        find(catalog, run["accelerator"])
        assert (run["gpus"] > 1) == strategies.get(run["strategy"]).multi_process
    for run in (r for r in bench.RUNS if r["spec"] == "llama3-8b.yaml"):   # torchtitan: op SAC, 8192 per example
        spec = load_spec(bench.SPECS / run["spec"], run["set"], check_files=False)
        assert spec.train.activation_checkpointing == "selective-2" and spec.data.max_length == 8192
        # torchtitan's Llama 3.1 tables: local batch 2, eager; torchao's float8 table: batch 1, compiled per block.
        torchao = run["source"].startswith(bench.TORCHAO)
        assert spec.train.micro_batch_size * spec.train.grad_accum_steps == (1 if torchao else 2) * run["gpus"]
        assert spec.train.compile == ("blocks" if torchao else "off")
        assert (spec.train.precision == "fp8") == ("float8" in run["job"]), run["job"]
    for run in (r for r in bench.RUNS if r["spec"] not in ("llama3-8b.yaml", PEFT_SPEC)):
        name, peak, allocated = run["spec"], run["published_bytes"], run["published_state_bytes"]
        spec = load_spec(bench.SPECS / name, run["set"], check_files=False)
        batch = spec.train.micro_batch_size
        adapter = spec.model.adapter
        if "full" in name:
            assert adapter is None and spec.train.optimizer.lr == 2e-5
        else:  # the CSV's lora_alpha 16 and lora_dropout 0.0
            assert (adapter.r, adapter.alpha, adapter.dropout, sorted(adapter.target_modules)) == (
                16, 16, 0.0, ["k_proj", "o_proj", "q_proj", "v_proj"])
        layers = 80 if name == "llama2-70b-qlora-fms.yaml" else 32
        assert spec.model.config["num_hidden_layers"] == layers and spec.train.activation_checkpointing
        assert ("mixtral" in name) == (spec.model.config.get("num_local_experts") == 8)
        assert spec.data.max_length == 4096 and spec.train.micro_batch_size == batch
        assert peak > allocated > 0
        # Over 2 GPUs the CSV's runs are accelerate's FSDP1, traced as pilotrun's fsdp over 2.
        assert (run["gpus"], run["strategy"]) in ((1, "single"), (2, "fsdp")) and ("FSDP1" in run["job"]) == (
            run["gpus"] == 2)
        quant = spec.model.quantization
        if "qlora" in name:
            # The fms plugin's loader: nf4 with double quantisation; TRL's fp32 upcast (prepare: peft) only in the
            # "baseline" scenario on one GPU, the plugin's own preparation (none) otherwise.
            assert (quant.bits, quant.type, quant.double_quant, spec.train.precision) == (4, "nf4", True, "bf16")
            baseline = int(run["source"].rsplit(" ", 1)[1]) in (24, 26)   # the CSV's baseline-peft-bnb rows
            assert quant.prepare == ("peft" if baseline else "none"), run["job"]
        else:
            assert quant is None and spec.train.precision == "bf16-true"
    for run in bench.NO_RESULT:   # runs the CSV left without a result at ~80 GB in use: set beside the estimate
        load_spec(bench.SPECS / run["spec"], run["set"], check_files=False)
        assert 79000 < run["nvidia_mem_reserved_mib"] <= 81920 and run["source"].startswith(bench.FMS)
        assert not any(r["spec"] == run["spec"] and r["set"] == run["set"] and r["gpus"] == run["gpus"]
                       for r in bench.RUNS)


def test_the_published_stack_s_rotary_caches_are_set_beside_the_ratio_never_in_it(monkeypatch):
    """transformers 4.39 kept every attention layer's rotary cos and sin, [max_position_embeddings, head_dim] in fp16:
    0.537 GB for Mistral-7B's 32 layers at 32768 positions, 0.168 GB for Llama-2-70B's 80 at 4096. The counted
    ratio stays the estimate's own."""
    bench = _bench()
    configs = {name: yaml.safe_load((bench.SPECS / name).read_text())["model"]["config"]
               for name in ("mistral-7b-lora.yaml", "llama2-70b-qlora-fms.yaml")}
    assert bench.rotary_cache_bytes(configs["mistral-7b-lora.yaml"]) == 32 * 2 * 32768 * 128 * 2 == 536870912
    assert bench.rotary_cache_bytes(configs["llama2-70b-qlora-fms.yaml"]) == 80 * 2 * 4096 * 128 * 2
    run = next(r for r in bench.RUNS if r["spec"] == "mistral-7b-lora.yaml")
    fake = {"fits": [{"peak_allocated_bytes": 20 * 2**30, "peak_reserved_bytes": 0, "limiting_stage": "x"}],
            "model": {"parameter_bytes": 10, "optimizer_state_bytes": 2}, "adapter": None}
    monkeypatch.setattr(bench, "estimate", lambda _run: fake)
    row = bench.compare(run)
    assert row["ratio"] == round(20 * 2**30 / run["published_bytes"], 4)
    assert row["ratio_with_published_stack"] == round((20 * 2**30 + 536870912) / run["published_bytes"], 4)
    assert row["estimated_state_bytes"] == 12


def test_the_offload_rows_say_what_the_peft_guide_ran():
    """huggingface/peft's FSDP guide: Llama-2-70B QLoRA (r 8, alpha 16, dropout 0.1, all-linear, nested nf4, bf16
    storage), flash_attention_2, 2 x 2048 packed, accumulation 2, checkpointing, FSDP1 over 2 GPUs with and without
    fsdp_offload_params (19.6 and 35.6 GB)."""
    rows = {r["set"][0]: r for r in _bench().RUNS if r["spec"] == PEFT_SPEC}
    assert set(rows) == {"distributed.offload=cpu", "distributed.offload=none"}
    assert rows["distributed.offload=cpu"]["published_bytes"] < rows["distributed.offload=none"]["published_bytes"]
    for run in rows.values():
        spec = load_spec(REPO / "bench" / "published" / PEFT_SPEC, run["set"], check_files=False)
        assert (run["strategy"], run["gpus"], spec.distributed.strategy) == ("fsdp", 2, "fsdp")
        adapter, quant = spec.model.adapter, spec.model.quantization
        assert (adapter.r, adapter.alpha, adapter.dropout, adapter.target_modules) == (8, 16, 0.1, "all-linear")
        assert (quant.bits, quant.type, quant.double_quant, quant.compute_dtype) == (4, "nf4", True, "bf16")
        assert spec.model.attn_implementation == "flash_attention_2" and spec.model.config["num_hidden_layers"] == 80
        assert (spec.train.micro_batch_size, spec.train.grad_accum_steps, spec.data.max_length) == (2, 2, 2048)
        assert spec.train.precision == "bf16-true-autocast" and spec.train.activation_checkpointing
        assert spec.distributed.offload == run["set"][0].split("=")[1]


def test_every_published_step_time_names_a_loadable_job_its_source_and_a_positive_time():
    jobs = yaml.safe_load((REPO / "bench" / "published" / "times.yaml").read_text())["jobs"]
    assert len(jobs) >= 17 and len({j["name"] for j in jobs}) == len(jobs)
    for job in jobs:
        spec = load_spec(REPO / "bench" / "published" / job["spec"], job.get("set", []), check_files=False)
        assert job["source"] and job["published_seconds_per_update"] > 0, job["name"]
        catalog = load_catalog(REPO / "bench" / "published" / job["catalog"]) if job.get("catalog") else load_catalog()
        find(catalog, job["accelerator"])
        strategy = strategies.get(job["strategy"])
        assert (job["gpus"] > 1) == strategy.multi_process, job["name"]
        # The per-GPU work the published row ran: whole micro batches on each GPU.
        assert spec.train.grad_accum_steps % strategy.compute_replicas(job["gpus"]) == 0, job["name"]
    # The pytorch.org blog's nanoGPT rows: one per attention kernel, nanoGPT b3c17c6's defaults otherwise.
    kernels = {}
    for job in (j for j in jobs if j["spec"] == "nanogpt-124m.yaml"):
        spec = load_spec(REPO / "bench" / "published" / job["spec"], job["set"], check_files=False)
        assert (spec.train.micro_batch_size, spec.train.grad_accum_steps, spec.data.max_length) == (12, 1, 1024)
        assert spec.train.compile == "model" and spec.train.precision == "bf16" and job["gpus"] == 1
        kernels[spec.model.attn_implementation, spec.model.config["vocab_size"]] = job["published_seconds_per_update"]
    assert kernels == {("eager", 50257): 0.143, ("sdpa", 50257): 0.113, ("sdpa", 50304): 0.087}
