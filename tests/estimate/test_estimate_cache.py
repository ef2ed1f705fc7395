"""Traces cached on disk as JSON: reused by the next command, bypassed on request, never trusted when corrupt."""
from __future__ import annotations

import json

import pytest

from pilotrun.config import load_spec
from pilotrun.estimate.cache import CacheStatus, TraceCache, trace_key
from tests.conftest import EXAMPLES, pilotrun_cli

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
    trace = full_trace()
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


def full_trace() -> dict:
    """A trace entry with every field the estimate reads (the shape trace.py writes), tiny numbers."""
    stage = {"peak_bytes": 100, "peak_bytes_rounded": 512, "breakdown": {"parameters": 8, "activations": 4},
             "tensors": 3, "flops": 1000, "seq_len": 8, "batch_size": 2, "optimizer_step_extra_bytes": 0,
             "phases": {"compute": [{"bytes": 90, "breakdown": {"parameters": 8}}]},
             "ops": [["bf16", 1000, 64, 1]], "optimizer_ops": [["fp32", 0, 96, 1]]}
    return {"stages": {"first_step": stage, "steady_step": stage, "eval": stage}, "parameters": 2,
            "trainable_parameters": 2, "parameter_bytes": 8, "gradient_bytes": 8, "optimizer_state_bytes": 16,
            "buffer_bytes": 0, "largest_layer_bytes": 8, "largest_layer": "lin", "layers": 1, "foreach": True,
            "precision": "bf16", "activation_checkpointing": False, "seconds": 1.5, "grad_accum_steps": 1,
            "max_positions": None, "notes": [], "optimizer": "adamw", "adaptation": {},
            "fsdp_parts": {part: {"fp32": 8 if part != "root" else 0, "stored": 0, "state": 0,
                                  "trainable": 8 if part != "root" else 0} for part in ("block", "root", "model")}}


def test_a_cached_trace_that_is_a_fifo_a_device_deep_or_of_the_wrong_shape_is_said_and_traced_again(tmp_path):
    """Found trying the cache as an attacker: a FIFO hung `estimate`, a link to /dev/zero raised MemoryError, deep
    nesting RecursionError, wrong types exit 3, and a negative cached peak printed "-909494701772928256.0 TiB"."""
    import os
    import threading

    cache = TraceCache(tmp_path / "traces")
    key = trace_key(_spec(), "cuda", False, "bf16")
    path = cache.path(key)
    path.parent.mkdir(parents=True)
    negative = full_trace()
    negative["stages"]["steady_step"] = {**negative["stages"]["steady_step"], "peak_bytes": -909494701772928256}
    wrong = {**full_trace(), "stages": {"first_step": [], "steady_step": "x", "eval": 1}}
    cases = {"deep": "[" * 100_000 + "]" * 100_000, "negative": json.dumps({"key": key, "trace": negative}),
             "wrong types": json.dumps({"key": key, "trace": wrong}), "nan": json.dumps(
                 {"key": key, "trace": {**full_trace(), "seconds": float("nan")}}),
             "a list of stages": json.dumps({"key": key, "trace": {**full_trace(), "stages": [1, 2]}})}
    for bad_row in (["bf16", -1000, 64, 1], ["bf16", 1000, 64], "x", [1, 2, 3, 4]):  # a negative time, a wrong shape
        ops = full_trace()
        ops["stages"]["steady_step"] = {**ops["stages"]["steady_step"], "ops": [bad_row]}
        cases[f"op row {bad_row!r}"] = json.dumps({"key": key, "trace": ops})
    for what, content in cases.items():
        path.write_text(content)
        got = cache.get(key)
        assert got.status is CacheStatus.UNUSABLE and "traced again" in got.note and str(path) in got.note, what
    path.unlink()
    path.symlink_to("/dev/zero")
    got = cache.get(key)
    assert got.status is CacheStatus.UNUSABLE and "link" in got.note
    path.unlink()
    os.mkfifo(path)
    box: dict = {}
    reader = threading.Thread(target=lambda: box.update(got=cache.get(key)), daemon=True)
    reader.start()
    reader.join(10)
    try:
        assert not reader.is_alive(), "reading a FIFO in the trace cache hangs"
        assert box["got"].status is CacheStatus.UNUSABLE and "not a regular file" in box["got"].note
    finally:
        if reader.is_alive():  # unblock the stuck open() so the test process can end
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


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
