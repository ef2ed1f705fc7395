"""Estimating a job before its data and tokenizer are on the machine (issue 12, deliverable 5).

``estimate``, ``select`` and ``plan`` need the model, the sizes and the training settings only; ``run``
still names the missing data file and tokenizer.
"""
from __future__ import annotations

import json

import pytest

from tests.conftest import pilotrun_cli, write_spec

pytestmark = pytest.mark.process  # each test runs the command line

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
    from pilotrun.estimate.catalog import load_catalog

    spec_path = write_spec(tmp_path / "pilot.yaml", SHAPE)
    catalog = load_catalog()
    names = set(catalog)
    untimed = {n for n, a in catalog.items() if a.peak_flops("fp32") is None}  # the catalog gives no fp32 rate
    res = pilotrun_cli("select", str(spec_path), cwd=tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "selection sheet · shape-only" in res.stdout, res.stdout
    # A row per built-in accelerator: the 2-layer shape fits each one alone at the spec's 2 x 2 per update,
    # with a traced memory use.
    rows = {cells[0]: cells for cells in map(str.split, res.stdout.splitlines()) if cells and cells[0] in names}
    assert set(rows) == names, res.stdout
    for name, cells in rows.items():
        assert cells[3:9] == ["yes", "single", "1", "2", "x", "2"], (name, cells)
        # largest micro batch, then the largest length at the spec's micro batch ("N at mb 2"), then memory used
        assert cells[10].isdigit() and cells[11:14] == ["at", "mb", "2"], (name, cells)
        assert float(cells[14]) > 0 and cells[15] in ("MiB", "GiB"), (name, cells)
    res = pilotrun_cli("plan", str(spec_path), "--runs", "2", cwd=tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    for name in names:  # a plan per accelerator, its training time from the spec's 20 updates where it has a rate
        assert f"{name} · single x1 · micro batch 2 x 2 · fits" in res.stdout, (name, res.stdout)
    lines = res.stdout.splitlines()
    training = [line for line in lines if line.split()[:1] == ["training"]]
    assert sum("20 updates x" in line for line in training) == len(names - untimed), training
    assert sum("no time estimate" in line for line in training) == len(untimed), training
    assert sum("3 days on 1 GPU(s): fits" in line for line in lines) == len(names)
    assert "model.config builds the model with random weights on the node: no weights to download" in res.stdout


def test_run_still_names_the_missing_data_file_and_tokenizer(tmp_path):
    spec_path = write_spec(tmp_path / "pilot.yaml", SHAPE)
    res = pilotrun_cli("run", str(spec_path), "--gates", "lock", cwd=tmp_path)
    assert res.returncode == 2
    assert "data.path: missing" in res.stdout + res.stderr
    assert "model.tokenizer: missing" in res.stdout + res.stderr
