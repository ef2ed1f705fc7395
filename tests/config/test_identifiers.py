"""Hostile names and values at the edges (issue 45): identifiers checked once by one rule, NUL bytes and over-long
names in a spec's fields and a manifest's file names, program.files globs that meet links out of the spec's folder,
and a damaged describe-cache entry. Each was an internal error (exit 3), a write outside runs/, or minutes spent
hashing the whole filesystem; each is now exit 2 (or a refusal) naming the flag, the field or the entry."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from pilotrun.cli import main
from pilotrun.config import SpecError, load_spec
from pilotrun.config.ids import ID_MAX, NAME_MAX, id_problem
from pilotrun.ledger.records import new_run_id
from tests.conftest import TEST_DIGEST, copy_fixture, pilotrun_cli, write_spec

REPO = Path(__file__).resolve().parents[2]

# -- one rule for every identifier -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [
    new_run_id("x" * NAME_MAX),                  # the longest id pilotrun makes for a pilot ...
    new_run_id("x" * NAME_MAX) + "-r100",        # ... and for a campaign's hundredth run
    "sky-managed-2023-07-06-21-18-31-563597_my-job-name_1-0",  # SkyPilot's $SKYPILOT_TASK_ID, as documented
    "sky-2023-07-06-21-18-31-563597_myclus_1",
    "tiny-sft", "a", "v1.2_b",
])
def test_the_ids_pilotrun_makes_and_schedulers_give_pass_the_rule(value):
    assert id_problem(value) is None


@pytest.mark.parametrize("value, words", [
    ("", "give 1 to"),
    ("../../x", "no path separator and no '..'"),
    ("a/b", "no path separator"),
    ("a\\b", "no path separator"),
    ("a..b", "no '..'"),
    ("x" * (ID_MAX + 1), f"at most {ID_MAX} characters"),
    ("a\0b", "NUL byte"),
    (".hidden", "starting with a letter or digit"),
    ("-rf", "starting with a letter or digit"),
    ("with space", "letters, digits"),
    ("caf\u00e9", "letters, digits"),
    (None, "give 1 to"),
])
def test_the_rule_refuses_what_would_leave_a_folder_or_break_a_name(value, words):
    why = id_problem(value)
    assert why is not None and words in why


def _spec_here(tmp_path: Path) -> Path:
    """The toy spec in tmp_path/a/b/toy/: `runs/../../x` run from its folder would land in tmp_path/a/b/x."""
    return copy_fixture("toy", tmp_path / "a" / "b")


def _nothing_written_beside(spec: Path) -> None:
    assert os.listdir(spec.parent.parent) == ["toy"] and not (spec.parent / "runs").exists()


@pytest.mark.parametrize("argv, flag", [
    (["run", "SPEC", "--run-id", "../../x"], "--run-id"),
    (["run", "SPEC", "--run-id", "a" * 300], "--run-id"),
    (["run", "SPEC", "--task-id", "../t"], "--task-id"),
    (["run", "SPEC", "--task-id", ""], "--task-id"),
    (["launch", "--nproc-per-node", "1", "SPEC", "--run-id", "a/../../b"], "--run-id"),
    (["launch", "--nproc-per-node", "1", "SPEC", "--task-id", "t\0"], "--task-id"),
    (["campaign", "SPEC", "--task-id", "../../t"], "--task-id"),
    (["ledger", "--name", "../x"], "--name"),
])
def test_an_identifier_flag_is_exit_2_naming_the_flag_before_anything_is_written(tmp_path, monkeypatch, capsys, argv,
                                                                                   flag):
    spec = _spec_here(tmp_path)
    monkeypatch.chdir(spec.parent)
    with pytest.raises(SystemExit) as done:
        main([str(spec) if a == "SPEC" else a for a in argv])
    err = " ".join(capsys.readouterr().err.split())
    assert done.value.code == 2 and f"argument {flag}:" in err and "Traceback" not in err, err
    _nothing_written_beside(spec)


@pytest.mark.process
def test_the_real_command_refuses_a_run_id_that_climbs_out_of_runs(tmp_path):
    """`pilotrun run --run-id ../../x` wrote runs/../../x/ two folders above runs/ (a 300-character id, exit 3, is
    refused the same way: test_an_identifier_flag_is_exit_2_naming_the_flag_before_anything_is_written)."""
    spec = _spec_here(tmp_path)
    env = {**os.environ, "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST, "COLUMNS": "200"}
    res = subprocess.run([str(REPO / ".venv" / "bin" / "pilotrun"), "run", str(spec), "--gates", "lock", "--run-id",
                          "../../x"], cwd=spec.parent, capture_output=True, text=True, timeout=120, env=env)
    err = " ".join(res.stderr.split())
    assert res.returncode == 2 and "argument --run-id:" in err and "no path separator and no '..'" in err, (
        res.stdout + res.stderr)
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr
    _nothing_written_beside(spec)


def test_archive_never_names_its_file_after_an_id_that_leaves_the_folder(tmp_path):
    """A ledger written before ids were checked: its run `../../x` would be archived as ../../x.tar.gz."""
    from pilotrun.ledger import Ledger

    work = tmp_path / "a" / "b"
    (work / "run").mkdir(parents=True)
    with Ledger(work / "ledger.sqlite") as led:
        led.start_run("../../x", "toy", "pilot", out_dir=str(work / "run"))
    res = pilotrun_cli("archive", "../../x", "--ledger", str(work / "ledger.sqlite"), cwd=work)
    assert res.returncode == 2 and "pass --out" in res.stderr and "no path separator" in res.stderr, res.stderr
    assert not list(tmp_path.rglob("*.tar.gz"))


# -- NUL bytes and over-long values in a spec's fields --------------------------------------------------------------------

TOY = {"name": "t", "model": {"factory": "toy:build_model", "dim": 16}, "data": {"factory": "toy:build_data"},
       "train": {"micro_batch_size": 2, "updates": 10, "optimizer": {"lr": 1.0e-3}}}
HF = {"name": "t", "model": {"hf": "./m"}, "data": {"task": "causal-lm", "max_length": 16, "path": "d.jsonl"},
      "train": {"micro_batch_size": 2, "updates": 10, "optimizer": {"lr": 1.0e-3}}}
PROGRAM: dict[str, Any] = {"name": "p", "program": {"command": "python train.py"}}
LONG = "x" * 5000


@pytest.mark.parametrize("base, key, value, field, words", [
    (HF, "data.path", "a\0b.jsonl", "data.path", "NUL byte"),
    (HF, "data.path", LONG, "data.path", "at most 1024"),
    (HF, "data.path", {"train": "t.jsonl", "val": "d/" + "y" * 300}, "data.path.val", "longer than 255 bytes"),
    (HF, "model.hf", "./m\0", "model.hf", "NUL byte"),
    (HF, "model.hf", "./" + LONG, "model.hf", "at most 1024"),
    (HF, "model.tokenizer", "./tok\0", "model.tokenizer", "NUL byte"),
    (HF, "model.tokenizer", "./" + LONG, "model.tokenizer", "at most 1024"),
    (PROGRAM, "program.command", "python train.py --x a\0b", "program.command", "word 4 contains a NUL byte"),
    (PROGRAM, "program.command", ["python", "train.py", "a\0b"], "program.command", "NUL byte"),
    (PROGRAM, "program.command", ["python", "train.py", "z" * 200_000], "program.command", "at most 32768"),
    (PROGRAM, "program.env", {"A\0B": "1"}, "program.env", "not an environment variable name"),
    (PROGRAM, "program.env", {"A" * 300: "1"}, "program.env", "at most 255"),
    (PROGRAM, "program.env", {"AB": "1\0"}, "program.env.AB", "NUL byte"),
    (PROGRAM, "program.env", {"AB": "v" * 200_000}, "program.env.AB", "at most 32768"),
    (PROGRAM, "program.files", ["tr\0ain.py"], "program.files[0]", "NUL byte"),
    (PROGRAM, "program.files", [LONG], "program.files[0]", "at most 1024"),
    (TOY, "pilot.variants.custom", {"../up": {"train.optimizer.lr": 1e-3}}, "pilot.variants.custom",
     "no path separator"),
    (TOY, "pilot.variants.custom", {"v\0": {"train.optimizer.lr": 1e-3}}, "pilot.variants.custom", "NUL byte"),
])
def test_a_nul_or_an_over_long_value_is_a_spec_problem_naming_its_field(tmp_path, base, key, value, field, words):
    folder = copy_fixture("toy", tmp_path).parent
    (folder / "train.py").write_text("print('never run')\n")
    spec = json.loads(json.dumps(base))
    node = spec
    for part in key.split(".")[:-1]:
        node = node.setdefault(part, {})
    node[key.split(".")[-1]] = value
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(folder / "s.yaml", spec), allow_program=True)
    assert any(f == field and words in m for f, m in info.value.problems), info.value.problems


def test_the_command_line_says_a_nul_in_program_env_as_exit_2(tmp_path):
    folder = tmp_path / "prog"
    folder.mkdir()
    (folder / "train.py").write_text("print('never run')\n")
    spec = write_spec(folder / "pilot.yaml", {**PROGRAM, "program": {**PROGRAM["program"], "env": {"SEED": "1\0"}}})
    res = pilotrun_cli("run", str(spec), cwd=tmp_path)
    assert res.returncode == 2 and "program.env.SEED" in res.stdout + res.stderr, res.stdout + res.stderr
    assert "NUL byte" in res.stdout + res.stderr and "Traceback" not in res.stdout + res.stderr
    assert not (tmp_path / "runs").exists()


# -- program.files: links out of the spec's folder, and the walk's bounds -----------------------------------------------

def _program(tmp_path: Path, files: list[str]) -> Path:
    folder = tmp_path / "prog"
    (folder / "src" / "sub").mkdir(parents=True)
    (folder / "train.py").write_text("print('never run')\n")
    (folder / "src" / "model.py").write_text("W = 1\n")
    (folder / "src" / "sub" / "util.py").write_text("U = 2\n")
    (folder / "to-root").symlink_to("/")  # a link to a folder far outside the spec's, and to everything
    (folder / "loop").symlink_to(".")  # a link back up: entered once
    return write_spec(folder / "pilot.yaml", {**PROGRAM, "program": {**PROGRAM["program"], "files": files}})


def test_a_glob_never_follows_a_link_out_of_the_spec_folder(tmp_path):
    from pilotrun.lock import program_lock

    started = time.monotonic()
    spec = load_spec(_program(tmp_path, ["**/*.py"]), allow_program=True)
    lock = program_lock(spec)
    # glob.glob walked / through the link: minutes of hashing the filesystem. Bounded to the spec's folder now.
    assert time.monotonic() - started < 20
    assert sorted(lock["files"]) == ["src/model.py", "src/sub/util.py", "train.py"]
    assert "to-root" in lock["files_from"] and "not followed" in lock["files_from"]


@pytest.mark.parametrize("pattern, words", [
    ("to-root/**/*.py", "names a file outside the spec's folder"),
    ("to-root/etc/*", "names a file outside the spec's folder"),
    ("/etc/passwd", "names a path outside"),
    ("../*.py", "names a path outside"),
])
def test_a_pattern_that_names_a_path_through_a_link_out_is_exit_2(tmp_path, pattern, words):
    started = time.monotonic()
    with pytest.raises(SpecError) as info:
        load_spec(_program(tmp_path, [pattern]), allow_program=True)
    assert time.monotonic() - started < 20
    problems = dict(info.value.problems)
    assert words in problems["program.files[0]"], problems


def test_a_glob_past_its_bounds_is_exit_2_saying_so(tmp_path, monkeypatch):
    from pilotrun.config import paths

    deep = tmp_path / "prog" / "src"
    spec = _program(tmp_path, ["src/**/*.py"])
    for _ in range(paths.GLOB_MAX_DEPTH + 2):
        deep = deep / "d"
    deep.mkdir(parents=True)
    (deep / "x.py").write_text("X = 1\n")
    with pytest.raises(SpecError) as info:
        load_spec(spec, allow_program=True)
    assert f"more than {paths.GLOB_MAX_DEPTH} folders deep" in dict(info.value.problems)["program.files[0]"]
    # The entry bound, lowered so that a test need not create 100,000 files: the walk stops at it and says so.
    monkeypatch.setattr(paths, "GLOB_MAX_ENTRIES", 20)
    for i in range(30):
        (tmp_path / "prog" / "src" / f"m{i}.py").write_text("")
    write_spec(spec, {**PROGRAM, "program": {**PROGRAM["program"], "files": ["src/*.py"]}})
    with pytest.raises(SpecError) as info:
        load_spec(spec, allow_program=True)
    assert "lists more than 20 files and folders" in dict(info.value.problems)["program.files[0]"]


# -- a manifest's file names ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, words", [
    ("model\0.pt", "a name with a NUL byte"),
    ("m" * 5000, "a name longer than a file name may be"),
    ("dcp/" + "s" * 300, "a name longer than a file name may be"),
    ("\ud800.pt", "not encodable as a file name"),
])
def test_a_manifest_naming_an_impossible_file_is_refused_as_damaged(tmp_path, name, words):
    import torch

    from pilotrun.checkpoint import AtomicFolder, LoadPolicy, LoadRefused, Refusal, verify_folder
    from pilotrun.checkpoint.io import CheckpointError

    folder = tmp_path / "step-000001"
    with AtomicFolder(folder, "checkpoint", {"step": 1}) as f:
        f.write_with("model.pt", torch.save, {"w": torch.arange(4.0)})
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": "0" * 64, "bytes": 1}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(LoadRefused) as info:
        LoadPolicy.of([], trust=True).admit(folder)
    assert info.value.kind is Refusal.DAMAGED
    assert any(words in p for p in info.value.problems), info.value.problems
    with pytest.raises(CheckpointError, match=words):
        verify_folder(folder)


# -- a damaged describe-cache entry ---------------------------------------------------------------------------------------

GOOD_FACTS = {"framework": "job.describe", "model_kind": "module", "model_class": "m.Net", "parameters": 10,
              "trainable_parameters": 10, "parameter_dtype": "float32", "micro_batch_size": 2,
              "optimizer": {"class": "torch.optim.adamw.AdamW", "name": "adamw", "lr": 1e-3, "betas": [0.9, 0.99]}}


@pytest.mark.parametrize("change, words", [
    ({"parameters": "many"}, "field 'parameters'"),
    ({"micro_batch_size": True}, "field 'micro_batch_size'"),
    ({"micro_batch_size": 0}, "below 1"),
    ({"notes": "one"}, "field 'notes'"),
    ({"config": ["model_type"]}, "field 'config'"),
    ({"max_grad_norm": float("nan")}, "field 'max_grad_norm'"),
    ({"optimizer": {"name": "adamw", "lr": 1e-3}}, "no 'class'"),
    ({"optimizer": {"class": "x.Opt", "name": None, "lr": "fast"}}, "not a number"),
    ({"quantization": {}}, "neither 'bits' nor 'unsupported'"),
    ({"config": {"model_type": "bert", "id2label": {"a": "x"}}}, "id2label"),
])
def test_a_damaged_description_is_refused_naming_the_field(change, words):
    from pilotrun.program.describe import JobFacts

    assert JobFacts.from_dict(GOOD_FACTS).optimizer == GOOD_FACTS["optimizer"]
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        JobFacts.from_dict({**GOOD_FACTS, **change})


DESCRIBES = """import torch
import pilotrun

job = pilotrun.program()
model = torch.nn.Linear(4, 2)
job.describe(model, torch.optim.AdamW(model.parameters(), lr=1e-3), micro_batch_size=2, updates=5)
"""


@pytest.mark.process
def test_a_poisoned_describe_cache_entry_is_described_again_overwritten_and_said(tmp_path, monkeypatch):
    """A cache entry with the right key and a string where the parameter count belongs was exit 3 (formatting the
    count): now the program is described again, the entry rewritten, and the output says so."""
    from pilotrun.estimate import program_job

    monkeypatch.setenv("PILOTRUN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "prog"
    folder.mkdir()
    (folder / "train.py").write_text(DESCRIBES)
    spec = write_spec(folder / "pilot.yaml", {"name": "own", "program": {"command": "python train.py"}})

    class Got(Exception):
        pass

    def grab(program, refresh):
        raise Got(program)

    with pytest.raises(Got) as got:
        program_job.load_job(spec, describe=grab)
    key = program_job.describe_key(got.value.args[0])
    entry = program_job._cache_path(key)
    entry.parent.mkdir(parents=True)
    entry.write_text(json.dumps({"key": key, "described_at": "2026-01-01T00:00:00Z",
                                 "facts": {**GOOD_FACTS, "parameters": "many"}}))
    facts, said = program_job.describe_program(got.value.args[0])
    assert facts.parameters == 4 * 2 + 2 and facts.micro_batch_size == 2
    assert f"the cached description {entry} is unusable (field 'parameters'" in said and "described again" in said
    assert f"cached as {entry}" in said
    rewritten = json.loads(entry.read_text())["facts"]  # what the program said, not the poisoned entry
    assert rewritten["parameters"] == 10 and rewritten["model_class"] == "torch.nn.modules.linear.Linear"
    again, said = program_job.describe_program(got.value.args[0])
    assert again == facts and "cached at" in said
