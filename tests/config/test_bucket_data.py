"""Data in a bucket (issue 47, item 5): ``data.path: s3://…`` is refused here with the way to the node, read on a
node where a task copied it (``$PILOTRUN_DATA_MOUNTS``), and the lock there records the URI, the files' hashes and
the bucket folder's listing; the plan's lock, which could not read it, is not a drift from the node's.
(The task that copies it is checked with SkyPilot's parser in tests/deploy/test_skypilot.py.)"""
from __future__ import annotations

import json
import shutil

import pytest

from pilotrun.config import load_spec
from pilotrun.config.paths import DATA_MOUNTS_VAR, bucket_folder
from pilotrun.config.schema import SpecError
from pilotrun.lock import collect_lock, diff_locks
from tests.conftest import EXAMPLES, gate_rows

URI = "s3://team-data/sft/data.jsonl"


def _demo(tmp_path):
    shutil.copytree(EXAMPLES / "tiny-sft", tmp_path / "job", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "job" / "pilot.yaml"


def test_a_bucket_path_is_refused_here_naming_the_way_to_the_node(tmp_path):
    spec = _demo(tmp_path)
    with pytest.raises(SpecError) as refused:
        load_spec(spec, [f"data.path={URI}"])
    said = str(refused.value)
    assert "data.path" in said and f"{URI} is in a bucket" in said and "plan --skypilot" in said, said
    assert "copy it down" in said and "--set KEY=PATH" in said
    # estimate, select and plan read no data: the spec holds for them.
    assert load_spec(spec, [f"data.path={URI}"], check_files=False).data.path == URI
    # Not a file a task can copy: a bad bucket name, the bucket itself, a folder, a key climbing out of its folder.
    for bad in ("s3://Team_Data!/x.jsonl", "s3://team-data", "s3://team-data/", "s3://team-data/sft/",
                "s3://team-data/../x.jsonl", "gs://ab/x.jsonl"):
        with pytest.raises(SpecError, match="not a bucket file a task can copy"):
            load_spec(spec, [f"data.path={bad}"], check_files=False)
    assert bucket_folder(URI) == "s3://team-data/sft" and bucket_folder("gs://bkt/top.jsonl") == "gs://bkt"


def test_the_task_copies_each_bucket_folder_once_and_a_model_in_a_bucket_is_refused():
    from pilotrun.cli.skypilot_task import _bucket_data

    split = load_spec(EXAMPLES / "tiny-sft" / "pilot.yaml", [
        "data.path.train=s3://team-data/sft/v2/train.jsonl", "data.path.val=s3://team-data/sft/val.jsonl"],
        check_files=False)
    folders, mounts = _bucket_data(split)
    assert folders == {"s3://team-data/sft": "/pilotrun-data/0"}  # v2/ is inside it: one copy
    assert mounts[0].src == "s3://team-data/sft" and "data.path.train" in mounts[0].why
    # Only data is copied from a bucket: a model there is refused when the spec is read, even by plan.
    with pytest.raises(SpecError, match="model.hf: s3://team-models/llama is in a bucket"):
        load_spec(EXAMPLES / "tiny-sft" / "pilot.yaml", ["model.config=null", "model.hf=s3://team-models/llama"],
                  check_files=False)


def test_where_a_task_copied_it_the_pilot_reads_it_and_the_lock_records_it(tmp_path, monkeypatch):
    spec = _demo(tmp_path)
    node = tmp_path / "node-data" / "0"  # where the task's file mount put s3://team-data/sft
    node.mkdir(parents=True)
    shutil.copy(tmp_path / "job" / "data.jsonl", node / "data.jsonl")
    (node / "notes.txt").write_text("also in the bucket folder\n")
    planned = collect_lock(load_spec(spec, [f"data.path={URI}"], check_files=False))  # plan's lock: not read
    assert planned["data"]["sha256"] is None and "in a bucket" in planned["data"]["not_read"]

    monkeypatch.setenv(DATA_MOUNTS_VAR, json.dumps({"s3://team-data/sft": str(node)}))
    loaded = load_spec(spec, [f"data.path={URI}"])
    assert loaded.resolve(URI) == node / "data.jsonl"
    rows = gate_rows(spec, tmp_path, f"data.path={URI}", gates=["lock", "load"])
    assert [r["verdict"] for r in rows.values()] == ["pass", "pass"], {g: r["reason"] for g, r in rows.items()}
    lock = collect_lock(loaded)
    local = collect_lock(load_spec(spec))  # the same file, read where the spec keeps it
    assert lock["data"]["uri"] == URI and lock["data"]["bucket_folder"] == "s3://team-data/sft"
    assert lock["data"]["sha256"] == local["data"]["sha256"] and lock["data"]["listing_files"] == 2
    assert len(lock["data"]["listing_sha256"]) == 64
    # The node's lock is the first to read the data: not a drift from the plan's.
    assert not [k for k, _, _ in diff_locks(planned, lock) if k.startswith("data.")]
    assert not [k for k, _, _ in diff_locks(lock, planned) if k.startswith("data.")]  # either way round
    # A file added to the bucket folder changes the listing: said as drift between two nodes' locks.
    (node / "more.jsonl").write_text("{}\n")
    moved = [k for k, _, _ in diff_locks(lock, collect_lock(loaded)) if k.startswith("data.")]
    assert moved == ["data.listing_files", "data.listing_sha256"]
