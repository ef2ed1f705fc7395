"""The lock: what a run depends on, and drift reported field by field."""
from __future__ import annotations

import json

import pytest

from pilotrun import lock as lock_mod
from pilotrun.config import load_spec
from pilotrun.lock import (
    ContainerDigestError,
    DriftKind,
    classify_drift,
    collect_lock,
    config_changes,
    diff_locks,
    resolve_container_digest,
    summarize_code,
    summarize_drift,
)
from tests.conftest import EXAMPLES, TEST_DIGEST, copy_example, copy_fixture, gate_rows, pilotrun_cli, require

DIGEST = "sha256:" + "ab" * 32


def test_lock_of_a_builtin_task_hashes_data_and_tokenizer(tmp_path):
    spec = load_spec(copy_example("tiny-sft", tmp_path))
    lock = collect_lock(spec, container_digest=DIGEST)
    assert len(lock["data"]["sha256"]) == 64 and "data.jsonl" in lock["data"]["files"]
    assert "tokenizer.json" in lock["model"]["tokenizer"]["files"]
    assert lock["model"]["source"] == "config"
    assert lock["container"] == {"digest": DIGEST, "from": "--container-digest"}
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
    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    spec = load_spec(copy_fixture("toy", tmp_path))
    lock = collect_lock(spec)
    assert lock["container"] == {"digest": TEST_DIGEST, "from": "$PILOTRUN_CONTAINER_DIGEST"}
    assert lock["model"]["source"] == "factory"


def test_summary_is_short_and_names_fields():
    old = {"a": {"b": 1, "c": "x"}, "d": 1}
    new = {"a": {"b": 2, "c": "x"}, "e": 1}
    drift = diff_locks(old, new)
    assert [k for k, _, _ in drift] == ["a.b", "d", "e"]
    text = summarize_drift(drift)
    assert "a.b: 1 -> 2" in text and '"<absent>"' in text


# -- the container digest ------------------------------------------------------------------------------------------

def test_a_digest_must_look_like_one(monkeypatch):
    monkeypatch.delenv("PILOTRUN_CONTAINER_DIGEST", raising=False)
    assert resolve_container_digest(None) == (None, None)
    assert resolve_container_digest(DIGEST) == (DIGEST, "--container-digest")
    named = "ghcr.io/org/train:1.2@" + DIGEST  # what `docker inspect` prints in RepoDigests
    assert resolve_container_digest(named) == (named, "--container-digest")
    for bad in ("abc", "sha256:abc", "sha256:" + "AB" * 32, "sha256:" + "a" * 63, "latest", "sha1:" + "a" * 40):
        with pytest.raises(ContainerDigestError, match="--container-digest .*sha256:<64 lowercase hex"):
            resolve_container_digest(bad)
    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", "sha256:test")
    with pytest.raises(ContainerDigestError, match=r"\$PILOTRUN_CONTAINER_DIGEST is 'sha256:test'"):
        resolve_container_digest(None)
    # The flag wins over the variable, and is the one checked.
    assert resolve_container_digest(DIGEST) == (DIGEST, "--container-digest")


@pytest.mark.process
def test_a_made_up_digest_is_exit_2_naming_the_flag_or_variable(tmp_path):
    spec = copy_example("tiny-sft", tmp_path)
    res = pilotrun_cli("run", str(spec), "--container-digest", "abc", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--container-digest is 'abc'" in res.stderr and "sha256:<64 lowercase hex" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "runs").exists()  # refused before anything ran
    res = pilotrun_cli("run", str(spec), cwd=tmp_path, env={"PILOTRUN_CONTAINER_DIGEST": "abc"})
    assert res.returncode == 2 and "$PILOTRUN_CONTAINER_DIGEST is 'abc'" in res.stderr, res.stderr
    res = pilotrun_cli("launch", "--nproc-per-node", "1", str(spec), "--container-digest", "abc", cwd=tmp_path)
    assert res.returncode == 2 and "--container-digest is 'abc'" in res.stderr, res.stderr
    res = pilotrun_cli("campaign", str(EXAMPLES / "campaign" / "lr-sweep.yaml"), cwd=tmp_path,
                       env={"PILOTRUN_CONTAINER_DIGEST": "sha256:test"})
    assert res.returncode == 2 and "$PILOTRUN_CONTAINER_DIGEST is 'sha256:test'" in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("inside", [False, True])
def test_no_digest_is_information_not_a_warning(tmp_path, monkeypatch, inside):
    monkeypatch.delenv("PILOTRUN_CONTAINER_DIGEST", raising=False)
    # Whether this machine is a container is a fact of the machine: both answers are exercised.
    monkeypatch.setattr(lock_mod, "in_container", lambda: inside)
    row = gate_rows(copy_example("tiny-sft", tmp_path), tmp_path, gates=["lock"])["lock"]
    assert row["verdict"] == "pass", row["reason"]
    said = "container digest not known" if inside else "not in a container: no image digest to record"
    assert row["reason"].count(said) == 1, row["reason"]


# -- the experiment changed, or the environment drifted ------------------------------------------------------------

def test_config_keys_are_the_experiment_and_the_rest_is_the_environment():
    old = {"config": {"train": {"micro_batch_size": 8}, "distributed": {"strategy": "single"}, "seed": 1},
           "config_hash": "a", "seeds": {"torch": 1}, "versions": {"torch": "2.6"}, "distributions": {"numpy": "1"},
           "container": {"digest": None}, "code": {"commit": "c1"},
           "model": {"source": "config", "random_init_seed": 1},
           "data": {"source": "jsonl", "path": "/d/a.jsonl", "sha256": "x", "files": {"a.jsonl": "x"}}}
    new = {"config": {"train": {"micro_batch_size": 4}, "distributed": {"strategy": "ddp"}, "seed": 2},
           "config_hash": "b", "seeds": {"torch": 2}, "versions": {"torch": "2.7"}, "distributions": {"numpy": "2"},
           "container": {"digest": DIGEST}, "code": {"commit": "c2"},
           "model": {"source": "config", "random_init_seed": 2},
           "data": {"source": "jsonl", "path": "/d/a.jsonl", "sha256": "y", "files": {"a.jsonl": "y"}}}
    kinds = classify_drift(diff_locks(old, new))
    assert {k for k, _, _ in kinds[DriftKind.EXPERIMENT]} == {
        "config.train.micro_batch_size", "config.distributed.strategy", "config.seed", "config_hash", "seeds.torch",
        "model.random_init_seed"}
    # Same data path, other content: the data drifted under the experiment, whatever else the user changed.
    assert {k for k, _, _ in kinds[DriftKind.ENVIRONMENT]} == {
        "versions.torch", "distributions.numpy", "container.digest", "data.sha256", "data.files.a.jsonl"}
    assert {k for k, _, _ in kinds[DriftKind.CODE]} == {"code.commit"}
    assert config_changes(kinds[DriftKind.EXPERIMENT]) == [
        ("distributed.strategy", "single", "ddp"), ("seed", 1, 2), ("train.micro_batch_size", 8, 4)]


def test_data_pointed_elsewhere_by_the_config_is_the_experiment():
    old = {"config": {"data": {"path": "a.jsonl"}}, "data": {"path": "/d/a.jsonl", "sha256": "x"}}
    new = {"config": {"data": {"path": "b.jsonl"}}, "data": {"path": "/d/b.jsonl", "sha256": "y"}}
    kinds = classify_drift(diff_locks(old, new))
    assert not kinds[DriftKind.ENVIRONMENT] and len(kinds[DriftKind.EXPERIMENT]) == 3


def test_the_gate_says_config_changes_and_warns_on_environment_drift(tmp_path, monkeypatch):
    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    spec = copy_example("tiny-sft", tmp_path)
    gate_rows(spec, tmp_path, gates=["lock"])
    row = gate_rows(spec, tmp_path, "distributed.strategy=ddp", "train.micro_batch_size=4", gates=["lock"])["lock"]
    assert row["verdict"] == "pass", row["reason"]
    assert ("config changed from" in row["reason"] and 'distributed.strategy "single" -> "ddp"' in row["reason"]
            and "train.micro_batch_size 8 -> 4" in row["reason"] and "no environment drift" in row["reason"])
    assert "drifted" not in row["reason"]
    # The same config on other data content (same file name): the environment drifted, a warning.
    data = spec.parent / "data.jsonl"
    data.write_text(data.read_text().replace("Paris", "Lyon"))
    row = gate_rows(spec, tmp_path, "distributed.strategy=ddp", "train.micro_batch_size=4", gates=["lock"])["lock"]
    assert row["verdict"] == "warn" and "the environment drifted from" in row["reason"], row["reason"]
    assert "data.sha256" in row["reason"] and "config changed" not in row["reason"]
    assert {d["kind"] for d in row["details"]["drift"]} == {"environment"}


@pytest.mark.process
def test_the_installed_distributions_do_not_depend_on_what_the_process_imported():
    # Ray puts its vendored packages (ray/thirdparty_files) on sys.path when imported; a lock taken after that
    # once listed their colorama, so a campaign resumed from a fresh process refused every run as drifted.
    import subprocess
    import sys

    require("ray", "ray[default]")
    code = ("import json, sys; {imp}; from pilotrun.lock import _distributions; "
            "print(json.dumps([_distributions(), [p for p in sys.path if 'thirdparty' in p]]))")
    plain, with_ray = (json.loads(subprocess.run([sys.executable, "-c", code.format(imp=imp)], capture_output=True,
                                                 text=True, check=True).stdout)
                       for imp in ("pass", "import ray"))
    assert with_ray[1], "ray no longer puts its vendored folder on sys.path; this test checks nothing now"
    assert plain[0] == with_ray[0]


def test_edits_of_the_programs_files_and_a_factorys_module_are_code_and_the_command_is_said_once():
    a, b = "73597b" + "0" * 58, "8e3a11" + "0" * 58
    long_old = ["python", "run_clm.py", "--model_type", "gpt2", "--per_device_train_batch_size", "8"]
    long_new = long_old[:-1] + ["4"]
    old = {"config": {"program": {"command": long_old}}, "program": {"command": long_old, "sha256": "x",
                                                                      "files": {"train.py": a}},
           "model": {"source": "factory", "factory": "m:build", "source_sha256": "s1"}}
    new = {"config": {"program": {"command": long_new}}, "program": {"command": long_new, "sha256": "y",
                                                                      "files": {"train.py": b, "model.py": a}},
           "model": {"source": "factory", "factory": "m:build", "source_sha256": "s2"}}
    kinds = classify_drift(diff_locks(old, new))
    assert {k for k, _, _ in kinds[DriftKind.CODE]} == {
        "program.sha256", "program.files.train.py", "program.files.model.py", "model.source_sha256"}
    assert not kinds[DriftKind.ENVIRONMENT]
    # program.command repeats config.program.command: said once, as the config change.
    assert config_changes(kinds[DriftKind.EXPERIMENT]) == [("program.command", long_old, long_new)]
    text = summarize_drift(config_changes(kinds[DriftKind.EXPERIMENT]))
    assert '"8"' in text and '"4"' in text, text  # the differing part, not the common start
    assert summarize_code(kinds[DriftKind.CODE]).count("edited") == 2 and "model.py new" in summarize_code(
        kinds[DriftKind.CODE])
    hashes = summarize_drift([("program.files.train.py", a, b)])
    assert hashes == "program.files.train.py: 73597b000000… -> 8e3a11000000…", hashes  # no unbalanced quotes


def test_the_default_program_files_are_the_script_and_the_local_modules_it_imports(tmp_path):
    from pilotrun.config.program import ProgramSpec, program_files

    (tmp_path / "train.py").write_text("import os\nimport torch\nimport model\nfrom utils.io import load\n"
                                       "from models.gpt import GPT\n")
    (tmp_path / "model.py").write_text("from layers import Block\n")
    (tmp_path / "layers.py").write_text("x = 1\n")
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text("")
    # Absolute imports resolve from the entry script's folder (sys.path[0]), not from the importing file's.
    (tmp_path / "utils" / "io.py").write_text("from . import fmt\nimport model\nimport helper\n")
    (tmp_path / "utils" / "helper.py").write_text("")  # `import helper` does not reach it from train.py's folder
    (tmp_path / "utils" / "fmt.py").write_text("def broken(:\n")  # does not parse: hashed, adds nothing
    (tmp_path / "models").mkdir()  # a namespace package: no __init__.py
    (tmp_path / "models" / "gpt.py").write_text("")
    (tmp_path / "unused.py").write_text("")
    files, why = program_files(ProgramSpec(command="python train.py --steps 3"), tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in files) == [
        "layers.py", "model.py", "models/gpt.py", "train.py", "utils/__init__.py", "utils/fmt.py", "utils/io.py"]
    assert "the local modules they import (model.py, utils/__init__.py, utils/io.py, models/gpt.py" in why, why


def test_an_edit_of_the_programs_own_file_is_a_code_change_not_environment_drift(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    folder = tmp_path / "own-loop"
    shutil.copytree(EXAMPLES / "own-loop", folder)
    from pilotrun.pilot import PilotOptions, run_pilot

    def lock_row() -> dict:
        spec = load_spec(folder / "pilot.yaml", allow_program=True)
        result = run_pilot(spec, PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "l.sqlite",
                                              gates=["lock"]))
        return {r["gate"]: r for r in result.rows}["lock"]

    lock_row()
    script = folder / "train.py"
    script.write_text(script.read_text() + "\n# tuned\n")
    row = lock_row()
    assert row["verdict"] == "pass", row["reason"]
    assert "code changed from" in row["reason"] and "train.py edited" in row["reason"], row["reason"]
    assert "drifted" not in row["reason"] and "config changed" not in row["reason"], row["reason"]
    assert {d["kind"] for d in row["details"]["drift"]} == {"code"}


def test_a_distribution_whose_metadata_cannot_be_read_is_named_not_a_crash(tmp_path, monkeypatch):
    info = tmp_path / "bad_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_bytes(b"Metadata-Version: 2.1\nName: bad\xff\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    dists, unreadable = lock_mod.read_distributions()
    assert unreadable == [(str(info / "METADATA"), "not UTF-8 text (byte 31: invalid start byte)")]
    assert "torch" in dists and not any(name.startswith("bad") for name in dists)
    assert lock_mod.installed_distributions() == dists  # the lock leaves it out; `lock check` names it
