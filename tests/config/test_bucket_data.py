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
    assert "--set data.path=FILE" in said
    # estimate, select and plan read no data: the spec holds for them.
    assert load_spec(spec, [f"data.path={URI}"], check_files=False).data.path == URI
    with pytest.raises(SpecError, match="not a bucket URI a task can copy"):
        load_spec(spec, ["data.path=s3://Team_Data!/x.jsonl"], check_files=False)
    assert bucket_folder(URI) == "s3://team-data/sft" and bucket_folder("gs://b/top.jsonl") == "gs://b"


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
    # A file added to the bucket folder changes the listing: said as drift between two nodes' locks.
    (node / "more.jsonl").write_text("{}\n")
    moved = [k for k, _, _ in diff_locks(lock, collect_lock(loaded)) if k.startswith("data.")]
    assert moved == ["data.listing_files", "data.listing_sha256"]
