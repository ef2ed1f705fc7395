"""Estimating a job before its data and tokenizer are on the machine (issue 12, deliverable 5).

``estimate``, ``select`` and ``plan`` need the model, the sizes and the training settings only; ``run``
still names the missing data file and tokenizer.
"""
from __future__ import annotations

import json

import pytest

from .conftest import pilotrun_cli, write_spec

# A small Llama shape: no data file, no tokenizer anywhere on disk.
SHAPE = {
    "name": "shape-only",
    "model": {"config": {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}},
    "data": {"task": "causal-lm", "max_length": 64},
    "train": {"micro_batch_size": 2, "grad_accum_steps": 2, "updates": 20, "optimizer": {"lr": 1e-4}},
}


@pytest.mark.parametrize("path", [None, "not-written-yet.jsonl"])
def test_estimate_needs_no_data_file_or_tokenizer(tmp_path, path):
    spec = dict(SHAPE, data=dict(SHAPE["data"], **({"path": path} if path else {})))
    spec_path = write_spec(tmp_path / "pilot.yaml", spec)
    res = pilotrun_cli("estimate", str(spec_path), "--accelerator", "H100-80GB", "--strategy", "single",
                       "--no-advice", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    # The trace ran on synthetic inputs of the spec's sizes: a real parameter count and a real peak.
    assert out["model"]["parameters"] > 0
    assert all(f["peak_allocated_bytes"] > 0 for f in out["fits"])


def test_select_and_plan_need_no_data_file_or_tokenizer(tmp_path):
    spec_path = write_spec(tmp_path / "pilot.yaml", SHAPE)
    for args in (["select", str(spec_path)], ["plan", str(spec_path), "--runs", "2"]):
        res = pilotrun_cli(*args, cwd=tmp_path)
        assert res.returncode == 0, (args, res.stderr)
        assert "Traceback" not in res.stderr


def test_run_still_names_the_missing_data_file_and_tokenizer(tmp_path):
    spec_path = write_spec(tmp_path / "pilot.yaml", SHAPE)
    res = pilotrun_cli("run", str(spec_path), "--gates", "lock", cwd=tmp_path)
    assert res.returncode == 2
    assert "data.path: missing" in res.stdout + res.stderr
    assert "model.tokenizer: missing" in res.stdout + res.stderr
