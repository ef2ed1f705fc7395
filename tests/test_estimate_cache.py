"""Traces cached on disk as JSON: reused by the next command, bypassed on request, never trusted when corrupt."""
from __future__ import annotations

import json

import pytest

from pilotrun.config import load_spec
from pilotrun.estimate.cache import CacheStatus, TraceCache, trace_key

from .conftest import EXAMPLES, pilotrun_cli

TINY = EXAMPLES / "tiny-sft" / "pilot.yaml"


def _spec(*overrides: str):
    return load_spec(TINY, list(overrides), check_files=False)


def test_the_key_follows_what_the_trace_reads():
    base = trace_key(_spec(), "cuda", False, "bf16")
    assert base == trace_key(_spec(), "cuda", False, "bf16")
    # The learning rate and the update budget change no tensor: one trace serves a learning-rate sweep.
    assert base == trace_key(_spec("train.optimizer.lr=0.5", "train.updates=7"), "cuda", False, "bf16")
    for changed in (trace_key(_spec("train.micro_batch_size=3"), "cuda", False, "bf16"),
                    trace_key(_spec("data.max_length=48"), "cuda", False, "bf16"),
                    trace_key(_spec("distributed.strategy=fsdp"), "cuda", False, "bf16"),
                    trace_key(_spec("train.optimizer.name=sgd"), "cuda", False, "bf16"),
                    trace_key(_spec(), "cuda", True, "bf16"),
                    trace_key(_spec(), "cuda", False, "fp32"),
                    trace_key(_spec(), "cpu", False, "bf16")):
        assert changed != base
    assert set(base["versions"]) == {"pilotrun", "torch", "transformers"} and base["versions"]["torch"]


def test_round_trip_and_every_unusable_file(tmp_path):
    cache = TraceCache(tmp_path / "traces")
    key = trace_key(_spec(), "cuda", False, "bf16")
    assert cache.get(key).status is CacheStatus.MISSING
    trace = {"stages": {"first_step": {}, "steady_step": {}, "eval": {}}, "parameter_bytes": 8,
             "optimizer_state_bytes": 16, "precision": "bf16", "seconds": 1.5}
    assert cache.put(key, trace, "2026-12-01T00:00:00Z") is None
    path = cache.path(key)
    assert json.loads(path.read_text())["trace"] == trace  # plain JSON on disk
    hit = cache.get(key)
    assert hit.status is CacheStatus.HIT and hit.trace == trace and str(path) in hit.note
    for content in ("{not json", "\x00\x01\x02", json.dumps({"key": key, "trace": {"stages": {}}}),
                    json.dumps({"key": {**key, "seed": 99}, "trace": trace}), "[]", ""):
        path.write_text(content)
        got = cache.get(key)
        assert got.status is CacheStatus.UNUSABLE and got.trace is None and "traced again" in got.note, content


def test_an_unwritable_cache_is_a_note_not_a_failure(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")  # fails for root too, unlike a chmod
    note = TraceCache(blocker / "traces").put(trace_key(_spec(), "cuda", False, "bf16"), {"stages": {}}, "now")
    assert note and "not cached" in note and "PILOTRUN_CACHE" in note


@pytest.mark.process
def test_estimate_reuses_bypasses_and_survives_a_corrupt_cache(tmp_path):
    env = {"PILOTRUN_CACHE": str(tmp_path / "cache")}

    def estimate(*extra: str) -> dict:
        res = pilotrun_cli("estimate", str(TINY), "--accelerator", "H100-80GB", "--json", *extra, cwd=tmp_path,
                           env=env)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        return json.loads(res.stdout)

    first = estimate()
    assert len(first["trace_cache"]) == 1 and "traced in" in first["trace_cache"][0]
    files = list((tmp_path / "cache" / "traces").glob("*.json"))
    assert len(files) == 1
    second = estimate()
    assert "used the cached trace" in second["trace_cache"][0] and str(files[0]) in second["trace_cache"][0]
    assert second["stages"] == first["stages"] and second["fits"] == first["fits"]
    files[0].write_bytes(b"\x80garbage{")
    third = estimate()
    assert "unreadable" in third["trace_cache"][0] and "traced again" in third["trace_cache"][0]
    assert third["stages"] == first["stages"]
    entry = json.loads(files[0].read_text())  # rewritten as a valid entry
    assert entry["trace"]["parameters"] == first["model"]["parameters"]
    fresh = estimate("--no-trace-cache")
    assert len(fresh["trace_cache"]) == 1 and "traced in" in fresh["trace_cache"][0]
