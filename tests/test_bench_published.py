"""bench/published_memory.py and bench/published_time.py compare the estimate with published GPU measurements; their
specs must keep loading and keep describing the published jobs (the comparisons trace 1B-13B models: `make bench`,
not CI)."""
from __future__ import annotations

import importlib.util

import yaml

from pilotrun import strategies
from pilotrun.config import load_spec
from pilotrun.estimate.catalog import find, load_catalog

from .conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("published_memory", REPO / "bench" / "published_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_published_jobs_specs_load_and_say_what_was_measured():
    bench = _bench()
    assert {r["spec"] for r in bench.RUNS} == {"mistral-7b-lora.yaml", "mistral-7b-qlora.yaml", "mistral-7b-full.yaml",
                                               "llama3-8b.yaml"}
    for run in bench.RUNS:
        assert run["counter"] in ("allocated", "reserved") and run["source"].startswith("https://"), run["job"]
        catalog = load_catalog(bench.SPECS / run["catalog"]) if run.get("catalog") else load_catalog()
        find(catalog, run["accelerator"])
        assert (run["gpus"] > 1) == strategies.get(run["strategy"]).multi_process
    for run in (r for r in bench.RUNS if r["spec"] == "llama3-8b.yaml"):   # torchtitan: op SAC, 2 x 8192 per GPU
        spec = load_spec(bench.SPECS / run["spec"], run["set"], check_files=False)
        assert spec.train.activation_checkpointing == "selective-2" and spec.data.max_length == 8192
        assert spec.train.micro_batch_size * spec.train.grad_accum_steps == 2 * run["gpus"]
    for run in (r for r in bench.RUNS if r["spec"] != "llama3-8b.yaml"):
        name, peak, allocated = run["spec"], run["published_bytes"], run["published_state_bytes"]
        spec = load_spec(bench.SPECS / name, run["set"], check_files=False)
        batch = spec.train.micro_batch_size
        adapter = spec.model.adapter
        if "full" in name:
            assert adapter is None and spec.train.optimizer.lr == 2e-5
        else:  # the CSV's lora_alpha 16 and lora_dropout 0.0
            assert (adapter.r, adapter.alpha, adapter.dropout, sorted(adapter.target_modules)) == (
                16, 16, 0.0, ["k_proj", "o_proj", "q_proj", "v_proj"])
        assert spec.model.config["num_hidden_layers"] == 32 and spec.train.activation_checkpointing
        assert spec.data.max_length == 4096 and spec.train.micro_batch_size == batch
        assert peak > allocated > 0
        quant = spec.model.quantization
        if "qlora" in name:
            assert (quant.bits, quant.type, quant.double_quant, spec.train.precision) == (4, "nf4", False, "bf16")
        else:
            assert quant is None and spec.train.precision == "bf16-true"


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
