"""The lock: what a run depends on, and drift reported field by field."""
from __future__ import annotations

from pilotrun.config import load_spec
from pilotrun.lock import collect_lock, diff_locks, summarize_drift

from .conftest import copy_example, copy_fixture


def test_lock_of_a_builtin_task_hashes_data_and_tokenizer(tmp_path):
    spec = load_spec(copy_example("tiny-sft", tmp_path))
    lock = collect_lock(spec, container_digest="sha256:abc")
    assert len(lock["data"]["sha256"]) == 64 and "data.jsonl" in lock["data"]["files"]
    assert "tokenizer.json" in lock["model"]["tokenizer"]["files"]
    assert lock["model"]["source"] == "config"
    assert lock["container"] == {"digest": "sha256:abc", "from": "--container-digest"}
    assert set(lock["versions"]) >= {"python", "torch", "cuda", "hip", "cudnn", "nccl"}
    assert lock["seeds"]["seed"] == 1234 and lock["config_hash"] == spec.config_hash()
    assert lock["code"] == {"commit": None, "dirty": None}  # a copy outside any git checkout


def test_changed_data_file_is_drift(tmp_path):
    path = copy_example("tiny-sft", tmp_path)
    before = collect_lock(load_spec(path))
    data = path.parent / "data.jsonl"
    data.write_text(data.read_text().replace("Paris", "Lyon"))
    drift = {k for k, _, _ in diff_locks(before, collect_lock(load_spec(path)))}
    assert "data.sha256" in drift and "data.files.data.jsonl" in drift
    assert "created_at" not in drift and not any(k.startswith("host.") for k in drift)


def test_environment_digest_and_hub_pinning(tmp_path, monkeypatch):
    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", "sha256:env")
    spec = load_spec(copy_fixture("toy", tmp_path))
    lock = collect_lock(spec)
    assert lock["container"]["digest"] == "sha256:env" and lock["model"]["source"] == "factory"


def test_summary_is_short_and_names_fields():
    old = {"a": {"b": 1, "c": "x"}, "d": 1}
    new = {"a": {"b": 2, "c": "x"}, "e": 1}
    drift = diff_locks(old, new)
    assert [k for k, _, _ in drift] == ["a.b", "d", "e"]
    text = summarize_drift(drift)
    assert "a.b: 1 -> 2" in text and '"<absent>"' in text
