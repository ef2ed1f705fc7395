"""``model.tokenizer`` as a Hub id: found in the local Hugging Face cache only (built here in a temporary cache with
the hub's own layout — blobs, symlinked snapshots, refs — never downloaded), and a clear exit 2 when it is not."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pilotrun.config import SpecError, load_spec
from pilotrun.lock import collect_lock
from pilotrun.models.loading import load_tokenizer
from tests.conftest import EXAMPLES, copy_example, gate_rows, pilotrun_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_tokenizer(hub: Path, repo_id: str, source: Path, extra: dict[str, bytes] | None = None) -> Path:
    """Put the files of ``source`` into ``hub`` as huggingface_hub lays out a download: content-addressed blobs,
    a snapshot folder of symlinks to them, and refs/main naming the commit."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    files = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()} | (extra or {})
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def spec_with_tokenizer(tmp_path: Path, value: str) -> Path:
    path = copy_example("tiny-sft", tmp_path)
    path.write_text(path.read_text().replace("tokenizer: tokenizer ", f"tokenizer: {value} "))
    assert f"tokenizer: {value} " in path.read_text()
    return path


@pytest.fixture
def hub(tmp_path, monkeypatch):
    hub = tmp_path / "hf-cache" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_a_cached_hub_id_is_the_tokenizer_and_is_locked(tmp_path, hub):
    # A model repo's weights sit beside the tokenizer in a snapshot: the lock hashes the tokenizer files only.
    snapshot = cache_tokenizer(hub, "acme/tiny-tok", EXAMPLES / "tiny-sft" / "tokenizer",
                               {"model.safetensors": b"not the tokenizer"})
    spec = load_spec(spec_with_tokenizer(tmp_path, "acme/tiny-tok"))
    tok = load_tokenizer(spec.model, spec.folder)
    ids = tok("The capital of France is Paris.")["input_ids"]
    reference = load_spec(EXAMPLES / "tiny-sft" / "pilot.yaml")
    assert ids == load_tokenizer(reference.model, reference.folder)("The capital of France is Paris.")["input_ids"] and len(ids) > 3
    locked = collect_lock(spec)["model"]["tokenizer"]
    assert locked["hub_id"] == "acme/tiny-tok" and locked["commit"] == COMMIT
    assert Path(locked["path"]) == snapshot and "model.safetensors" not in locked["files"]
    own = json.loads(json.dumps(collect_lock(reference)["model"]["tokenizer"]["files"]))
    assert locked["files"] == own  # the same bytes, hashed through the symlinks


def test_a_local_folder_of_the_same_name_wins_over_the_cache(tmp_path, hub):
    cache_tokenizer(hub, "tokenizer", EXAMPLES / "tiny-sft" / "tokenizer")
    spec = load_spec(copy_example("tiny-sft", tmp_path))  # tokenizer: tokenizer — the folder beside the spec
    assert spec.tokenizer_source().hub_id is None and spec.tokenizer_source().path == spec.folder / "tokenizer"


def test_a_hub_id_not_in_the_cache_names_the_field_and_how_to_get_one(tmp_path, hub):
    with pytest.raises(SpecError) as err:
        load_spec(spec_with_tokenizer(tmp_path, "gpt2"))
    [(field, message)] = err.value.problems
    assert field == "model.tokenizer"
    assert "'gpt2' is not in the local Hugging Face cache" in message and str(hub) in message
    assert "never downloads" in message and 'README, "Tokenizers"' in message
    assert "examples/tiny-sft/make_data.py" in message


def test_a_snapshot_without_tokenizer_files_is_refused(tmp_path, hub):
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    (weights_only / "config.json").write_text("{}")
    cache_tokenizer(hub, "acme/model-only", weights_only)
    with pytest.raises(SpecError, match="has no tokenizer files"):
        load_spec(spec_with_tokenizer(tmp_path, "acme/model-only"))


@pytest.mark.process
def test_the_command_line_runs_with_a_cached_id_and_refuses_a_missing_one(tmp_path, hub):
    cache_tokenizer(hub, "acme/tiny-tok", EXAMPLES / "tiny-sft" / "tokenizer")
    work = tmp_path / "work"
    work.mkdir()
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    good = spec_with_tokenizer(tmp_path / "good", "acme/tiny-tok")
    res = pilotrun_cli("run", str(good), "--gates", "lock,load", "--json", cwd=work, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = {r["gate"]: r for r in json.loads(res.stdout)["gates"]}
    assert rows["load"]["verdict"] == "pass" and rows["lock"]["details"]["model"]["tokenizer"]["hub_id"] == \
        "acme/tiny-tok"
    bad = spec_with_tokenizer(tmp_path / "bad", "gpt2")
    res = pilotrun_cli("run", str(bad), cwd=work, env=env)
    assert res.returncode == 2 and "model.tokenizer" in res.stderr and "gpt2" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_gate_rows_are_unchanged_for_a_local_tokenizer(tmp_path, hub):
    rows = gate_rows(copy_example("tiny-sft", tmp_path), tmp_path, gates=["lock", "load"])
    assert rows["load"]["verdict"] == "pass" and "hub_id" not in rows["lock"]["details"]["model"]


def test_a_snapshot_missing_a_tokenizer_file_the_repo_lists_says_so(tmp_path, hub):
    snapshot = cache_tokenizer(hub, "acme/partial", EXAMPLES / "tiny-sft" / "tokenizer")
    # huggingface_hub's own record of the repo's files at that commit (written by a real download) lists one more.
    listed = {p.name: {"size": p.stat().st_size, "blob_id": "x", "lfs_sha256": None, "lfs_size": None,
                       "xet_hash": None} for p in snapshot.iterdir()}
    listed["merges.txt"] = {"size": 1, "blob_id": "y", "lfs_sha256": None, "lfs_size": None, "xet_hash": None}
    from huggingface_hub._snapshot_download import write_tree_cache
    from huggingface_hub._tree_cache import TreeCacheEntry  # private: the test builds what a download leaves

    write_tree_cache(str(snapshot.parents[1]), COMMIT, {k: TreeCacheEntry(**v) for k, v in listed.items()})
    with pytest.raises(SpecError, match="cached snapshot of 'acme/partial' is incomplete.*merges.txt"):
        load_spec(spec_with_tokenizer(tmp_path, "acme/partial"))
