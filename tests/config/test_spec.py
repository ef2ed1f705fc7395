"""The spec is validated once, at the edge: every problem named with its field, no traceback."""
from __future__ import annotations

import copy
import pickle

import pytest

from pilotrun.config import SpecError, load_spec
from pilotrun.config.schema import Problem, ProblemKind, build, describe_fields
from pilotrun.config.spec import Spec
from tests.conftest import copy_fixture, write_spec

VALID = {
    "name": "t",
    "model": {"factory": "toy:build_model", "dim": 16},
    "data": {"factory": "toy:build_data"},
    "train": {"micro_batch_size": 2, "updates": 10, "optimizer": {"lr": 1.0e-3}},
}


@pytest.fixture
def toy_dir(tmp_path):
    return copy_fixture("toy", tmp_path).parent


def problems_for(toy_dir, spec: dict) -> dict[str, str]:
    path = write_spec(toy_dir / "s.yaml", spec)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return dict(info.value.problems)


def with_change(path: str, value) -> dict:
    spec = copy.deepcopy(VALID)
    node = spec
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is DELETE:
        node.pop(keys[-1])
    else:
        node[keys[-1]] = value
    return spec


DELETE = object()


def test_valid_spec_fills_defaults(toy_dir):
    spec = load_spec(write_spec(toy_dir / "s.yaml", VALID))
    assert spec.train.grad_accum_steps == 1
    assert spec.train.precision == "fp32"
    assert spec.train.scheduler.name == "constant"
    assert spec.eval_batch_size == 2  # defaults to the micro batch
    assert spec.model.extra == {"dim": 16}  # factory arguments are kept
    assert spec.model.factory_mapping()["dim"] == 16 and spec.model.factory_mapping()["factory"] == "toy:build_model"


def test_a_section_keeps_its_mapping_as_written_outside_the_config(toy_dir):
    import dataclasses

    spec = load_spec(write_spec(toy_dir / "s.yaml", VALID))
    assert spec.model.factory_mapping() == VALID["model"] and spec.data.factory_mapping() == VALID["data"]
    assert "written" not in spec.canonical()["model"] and "written" not in spec.canonical()["data"]
    assert dataclasses.replace(spec.model, adapter=None).factory_mapping() == VALID["model"]
    # A factory's own argument of that name is the user's: kept in the config, passed to the factory.
    named = load_spec(write_spec(toy_dir / "n.yaml", with_change("model.written", 3)))
    assert named.canonical()["model"]["written"] == 3 and named.model.factory_mapping()["written"] == 3
    assert "unknown key" in problems_for(toy_dir, {**VALID, "model": {"config": {"model_type": "llama"},
                                                                      "written": {}}})["model.written"]


def test_config_hash_is_stable_and_sensitive(toy_dir):
    a = load_spec(write_spec(toy_dir / "a.yaml", VALID))
    b = load_spec(write_spec(toy_dir / "b.yaml", VALID))
    c = load_spec(write_spec(toy_dir / "c.yaml", with_change("train.optimizer.lr", 2.0e-3)))
    assert a.config_hash() == b.config_hash()
    assert a.config_hash() != c.config_hash()


def test_scheduler_shorthand_and_yaml_float_strings(toy_dir):
    spec = load_spec(write_spec(toy_dir / "s.yaml", with_change("train.scheduler", "cosine")))
    assert spec.train.scheduler.name == "cosine"
    # YAML 1.1 reads 1e-4 (no dot) as a string; people write it anyway.
    (toy_dir / "f.yaml").write_text(
        "name: t\nmodel: {factory: 'toy:build_model'}\ndata: {factory: 'toy:build_data'}\n"
        "train: {micro_batch_size: 2, updates: 3, optimizer: {lr: 1e-4}}\n")
    assert load_spec(toy_dir / "f.yaml").train.optimizer.lr == pytest.approx(1e-4)


@pytest.mark.parametrize("change, field, words", [
    (("trian", {"x": 1}), "trian", "unknown key; did you mean 'train'"),
    (("train.micro_batch", 2), "train.micro_batch", "did you mean 'micro_batch_size'"),
    (("train.micro_batch_size", "two"), "train.micro_batch_size", "expected an integer, got 'two'"),
    (("train.micro_batch_size", 0), "train.micro_batch_size", "at least 1"),
    (("train.updates", DELETE), "train.updates", "missing"),
    (("train.precision", "bf61"), "train.precision", "did you mean 'bf16'"),
    (("train.optimizer.lr", -1), "train.optimizer.lr", "positive"),
    (("train.optimizer.name", "adam"), "train.optimizer.name", "one of 'adamw', 'sgd'"),
    (("train.device", "gpu"), "train.device", "expected auto, cpu, cuda"),
    (("train.scheduler", {"name": "cosine", "warmup": 5}), "train.scheduler.warmup", "did you mean 'warmup_updates'"),
    (("seed", 1.5), "seed", "expected an integer"),
    (("name", "my job!"), "name", "letters, digits"),
    (("pilot.updates", 1), "pilot.updates", "at least 2"),
    (("eval.batch_size", 0), "eval.batch_size", "at least 1"),
])
def test_bad_fields_are_named(toy_dir, change, field, words):
    problems = problems_for(toy_dir, with_change(*change))
    assert field in problems, problems
    assert words in problems[field], problems[field]


def test_all_problems_reported_at_once(toy_dir):
    spec = with_change("train.micro_batch_size", "x")
    spec["train"]["precision"] = "fp4"
    spec["bogus"] = 1
    problems = problems_for(toy_dir, spec)
    assert {"train.micro_batch_size", "train.precision", "bogus"} <= set(problems)


def test_model_needs_exactly_one_source(toy_dir):
    spec = with_change("model.hf", "./somewhere")
    assert "give exactly one of model.factory, model.hf or model.config" in problems_for(toy_dir, spec)["model"]
    spec = copy.deepcopy(VALID)
    spec["model"] = {}
    assert "exactly one" in problems_for(toy_dir, spec)["model"]


def test_unknown_model_key_without_factory(toy_dir):
    spec = copy.deepcopy(VALID)
    spec["model"] = {"config": {"model_type": "llama"}, "hidden": 4, "tokenizer": "."}
    assert "unknown key" in problems_for(toy_dir, spec)["model.hidden"]


def test_schema_problems_carry_their_kind():
    with pytest.raises(SpecError) as info:
        build(Spec, {"name": "t", "model": {"factory": "toy:build_model"}, "data": 3})
    kinds = {p[0]: Problem.kind_of(p) for p in info.value.problems}
    assert kinds == {"data": ProblemKind.INVALID, "train": ProblemKind.MISSING}
    missing = next(p for p in info.value.problems if p[0] == "train")
    assert missing == ("train", missing[1]) and dict([missing]) == {"train": missing[1]}  # still a (field, message)
    for copied in (copy.deepcopy(missing), pickle.loads(pickle.dumps(missing))):
        assert copied == missing and copied.kind is ProblemKind.MISSING


def test_a_missing_section_gets_the_program_hint_by_its_kind(toy_dir):
    spec = copy.deepcopy(VALID)
    del spec["train"]
    spec["data"] = "toy:build_data"  # the wrong type, in a section that may also be left out with program:
    problems = problems_for(toy_dir, spec)
    assert problems["train"].startswith("missing; expected a mapping")
    assert problems["train"].endswith("(or pilot your own training program with program.command instead)")
    assert "program.command" not in problems["data"]


def test_builtin_task_needs_path_and_length(toy_dir):
    spec = copy.deepcopy(VALID)
    spec["data"] = {"task": "causal-lm"}
    problems = problems_for(toy_dir, spec)
    assert "data.path" in problems and "data.max_length" in problems


def test_missing_data_file_is_named(toy_dir):
    spec = copy.deepcopy(VALID)
    spec["data"] = {"task": "seq-classification", "path": "nope.jsonl", "max_length": 16}
    spec["model"] = {"factory": "toy:build_model", "tokenizer": "."}
    problems = problems_for(toy_dir, spec)
    assert "not found" in problems["data.path"] and "nope.jsonl" in problems["data.path"]


def test_factory_import_problems(toy_dir):
    assert "cannot import 'nomodule:f'" in problems_for(toy_dir, with_change("model.factory", "nomodule:f"))["model.factory"]
    assert "no attribute 'nothing'" in problems_for(toy_dir, with_change("model.factory", "toy:nothing"))["model.factory"]
    assert "module:function" in problems_for(toy_dir, with_change("data.factory", "toy.build_data"))["data.factory"]
    (toy_dir / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    msg = problems_for(toy_dir, with_change("model.factory", "broken:f"))["model.factory"]
    assert "RuntimeError: boom at import" in msg


@pytest.mark.parametrize("text, words", [
    ("name: [unclosed\n", "not valid YAML at line"),
    ("", "is empty"),
    ("- a\n- b\n", "must be a mapping"),
])
def test_unreadable_specs(tmp_path, text, words):
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "p.yaml")
    assert words in str(info.value)


def test_missing_spec_file_and_folder(tmp_path):
    with pytest.raises(SpecError, match="spec file not found"):
        load_spec(tmp_path / "none.yaml")
    with pytest.raises(SpecError, match="got a folder"):
        load_spec(tmp_path)


def test_overrides_apply_before_validation(toy_dir):
    path = write_spec(toy_dir / "s.yaml", VALID)
    spec = load_spec(path, ["train.micro_batch_size=4", "train.optimizer.lr=2e-3"])
    assert spec.train.micro_batch_size == 4 and spec.train.optimizer.lr == pytest.approx(2e-3)
    with pytest.raises(SpecError) as info:
        load_spec(path, ["train.micro_batch_size=-3"])
    assert "train.micro_batch_size" in dict(info.value.problems)
    with pytest.raises(SpecError, match="expected key=value"):
        load_spec(path, ["train.micro_batch_size"])


def test_every_field_is_documented():
    rows = describe_fields(Spec)
    names = {r[0] for r in rows}
    for fixed in ("name", "seed", "model.factory", "model.hf", "model.revision", "model.config", "data.factory",
                  "data.task", "data.path", "data.max_length", "train.micro_batch_size", "train.grad_accum_steps",
                  "train.updates", "train.precision", "train.optimizer.name", "train.optimizer.lr", "train.scheduler",
                  "eval.batch_size", "eval.max_length"):
        assert fixed in names, fixed
    undocumented = [r[0] for r in rows if not r[3]]
    assert "source" not in names
    assert not undocumented, undocumented


def test_module_shadowed_by_the_standard_library_is_explained(toy_dir):
    import json  # noqa: F401  (already imported, as in any real process)

    (toy_dir / "json.py").write_text("def build(cfg):\n    return None\n")
    msg = problems_for(toy_dir, with_change("model.factory", "json:build"))["model.factory"]
    assert "'json' resolved to" in msg and "rename your file" in msg


def test_a_second_spec_folder_gets_its_own_modules_not_the_siblings_the_first_imported(tmp_path):
    """Two specs in one process (the Python API, the suite's in-process pilots): the first folder's factory imports a
    sibling; the second folder has a module of that sibling's name. Found when one test's `be:build_model`, importing
    its `toylm`, made a later test's `toylm:build_model` resolve to the earlier folder."""
    from pilotrun.config.factories import import_factory

    for name, value in (("a", 1), ("b", 2)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "helper_pr.py").write_text(f"VALUE = {value}\ndef build():\n    return VALUE\n")
        (folder / "entry_pr.py").write_text("from helper_pr import VALUE\ndef build():\n    return VALUE\n")
    assert import_factory("entry_pr:build", tmp_path / "a")() == 1  # imports a/helper_pr as a sibling
    assert import_factory("helper_pr:build", tmp_path / "b")() == 2  # b's own module, not a's
    assert import_factory("entry_pr:build", tmp_path / "b")() == 2  # b's entry sees b's sibling
    assert import_factory("entry_pr:build", tmp_path / "a")() == 1  # and back


def test_override_errors_say_they_came_from_set(toy_dir):
    path = write_spec(toy_dir / "s.yaml", VALID)
    with pytest.raises(SpecError) as info:
        load_spec(path, ["train.precision=fp4"])
    assert "(value from --set)" in dict(info.value.problems)["train.precision"]


@pytest.mark.parametrize("change, field, words", [
    (("train.optimizer.lr", "abc"), "train.optimizer.lr", "expected a number, got 'abc'"),
    (("train.optimizer.lr", None), "train.optimizer.lr", "got nothing"),
    (("train.optimizer.lr", float("inf")), "train.optimizer.lr", "expected a finite number"),
    (("train.optimizer.lr", float("nan")), "train.optimizer.lr", "expected a finite number"),
    (("eval.batch_size", "x"), "eval.batch_size", "expected an integer"),
    (("name", 2024), "name", "expected a string"),
])
def test_wrong_types_never_reach_cross_field_checks(toy_dir, change, field, words):
    # These used to crash in check() (comparing a string with a number): exit 3 instead of 2.
    problems = problems_for(toy_dir, with_change(*change))
    assert words in problems[field], problems


def test_factory_module_that_exits_at_import(toy_dir):
    (toy_dir / "quits.py").write_text("import sys\nprint('not configured')\nsys.exit(0)\n")
    msg = problems_for(toy_dir, with_change("model.factory", "quits:build"))["model.factory"]
    assert "called sys.exit(0)" in msg


def test_model_config_keys_are_fields_of_the_architecture(tmp_path):
    spec = {"name": "c", "model": {"config": {"model_type": "llama", "hidden_sise": 64}, "tokenizer": "tok"},
            "data": {"task": "causal-lm", "path": "d.jsonl", "max_length": 8},
            "train": {"micro_batch_size": 1, "updates": 1, "optimizer": {"lr": 0.1}}}
    path = write_spec(tmp_path / "s.yaml", spec)
    with pytest.raises(SpecError) as info:
        load_spec(path, check_files=False)  # the estimator needs no data files...
    problems = dict(info.value.problems)
    assert "did you mean 'hidden_size'" in problems["model.config.hidden_sise"]  # ...but a typo is still caught
    assert set(problems) == {"model.config.hidden_sise"}
    spec["model"]["config"] = {"model_type": "lama"}
    with pytest.raises(SpecError, match="unknown architecture 'lama' \\(did you mean 'llama'"):
        load_spec(write_spec(tmp_path / "s.yaml", spec), check_files=False)


def test_spec_reference_matches_the_declarations():
    from pathlib import Path

    from pilotrun.config.reference import markdown

    written = (Path(__file__).resolve().parents[2] / "docs" / "spec.md").read_text()
    assert written == markdown(), "docs/spec.md is stale: python -m pilotrun.config.reference > docs/spec.md"
    assert "| `model.adapter.r` |" in written and "| `train.precision` |" in written
