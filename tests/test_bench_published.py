"""bench/published_memory.py compares the estimate with published GPU measurements; its specs must keep loading
and keep describing the published jobs (the comparison itself traces 7B models: `make bench`, not CI)."""
from __future__ import annotations

import importlib.util

from pilotrun.config import load_spec

from .conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("published_memory", REPO / "bench" / "published_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_published_jobs_specs_load_and_say_what_was_measured():
    bench = _bench()
    assert {r[1] for r in bench.RUNS} == {"mistral-7b-lora.yaml", "mistral-7b-qlora.yaml"}
    for _, name, batch, _, peak, allocated in bench.RUNS:
        spec = load_spec(bench.SPECS / name, [f"train.micro_batch_size={batch}"], check_files=False)
        adapter = spec.model.adapter
        assert (adapter.r, adapter.alpha, sorted(adapter.target_modules)) == (
            16, 16, ["k_proj", "o_proj", "q_proj", "v_proj"])
        assert spec.model.config["num_hidden_layers"] == 32 and spec.train.activation_checkpointing
        assert spec.data.max_length == 4096 and spec.train.micro_batch_size == batch
        assert peak > allocated > 0
        quant = spec.model.quantization
        if "qlora" in name:
            assert (quant.bits, quant.type, quant.double_quant, spec.train.precision) == (4, "nf4", False, "bf16")
        else:
            assert quant is None and spec.train.precision == "bf16-true"
