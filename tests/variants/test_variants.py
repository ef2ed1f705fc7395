"""`pilotrun variants` (issue 21, deliverable 1): the memory fixes run beside the control from the same weights on
the same examples, measured, judged against the control, and written to a real SQLite ledger, each variant's row
linked to the control's."""
from __future__ import annotations

import json
import math

import pytest

from pilotrun.config import load_spec
from pilotrun.ledger.details import VariantDetails
from pilotrun.ledger.records import VARIANT_ROW, RunKind
from pilotrun.ledger.store import Ledger
from pilotrun.variants.define import Kind, Skipped, compare_specs, plan_variants
from pilotrun.variants.judge import UpdatePoint, compare_updates, judge, time_ratio
from pilotrun.variants.run import run_variants
from tests.conftest import copy_example, pilotrun_cli, write_spec

# -- what runs, and what each holds ------------------------------------------------------------------------------


@pytest.fixture
def demo(tmp_path):
    return copy_example("tiny-sft", tmp_path)


def test_the_builtin_variants_follow_the_fix_order_and_skip_what_the_control_already_does(demo):
    planned = plan_variants(load_spec(demo))
    assert [v.name for v in planned.run] == ["micro-batch-half", "checkpointing-selective", "checkpointing-selective-2",
                                             "checkpointing-every-2", "checkpointing", "bf16", "fp16", "bf16-true"]
    assert planned.run[1].settings == {"train.activation_checkpointing": "selective"}
    assert planned.run[2].settings == {"train.activation_checkpointing": "selective-2"}
    assert planned.run[4].settings == {"train.activation_checkpointing": True}
    half = planned.run[0]
    assert half.settings == {"train.micro_batch_size": 4, "train.grad_accum_steps": 4} and half.kind == Kind.MEMORY_FIX
    assert half.overrides == ["train.micro_batch_size=4", "train.grad_accum_steps=4"]

    already = plan_variants(load_spec(demo, ["train.precision=bf16", "train.micro_batch_size=3",
                                             "train.activation_checkpointing=true"]))
    assert [v.name for v in already.run] == ["checkpointing-selective", "checkpointing-selective-2",
                                             "checkpointing-every-2", "fp16", "bf16-true"]
    why = {s.name: s.why for s in already.skipped}
    assert why == {"micro-batch-half": "the micro batch is 3: it cannot be halved exactly",
                   "checkpointing": "the control already uses it (train.activation_checkpointing: True)",
                   "bf16": "the control already trains in bf16"}
    assert all(isinstance(s, Skipped) for s in already.skipped)


def test_a_variant_that_changes_the_question_is_named_a_different_experiment(demo):
    control = load_spec(demo)
    half = compare_specs(control, load_spec(demo, ["train.micro_batch_size=4", "train.grad_accum_steps=4"]))
    assert half.same_question and half.held[0] == "examples per update 16 (held)"
    assert set(half.changed) == {"train.micro_batch_size", "train.grad_accum_steps"}
    shorter = compare_specs(control, load_spec(demo, ["data.max_length=64"]))
    assert shorter.question == ["data.max_length"] and "max length 64 (the control's 96)" in shorter.held
    fewer = compare_specs(control, load_spec(demo, ["train.micro_batch_size=4"]))
    assert fewer.question == ["examples per update"] and fewer.held[0] == "examples per update 8 (the control's 16)"
    adapter = compare_specs(control, load_spec(demo, ["model.adapter={r: 4}"]))
    assert any(q.startswith("model.adapter") for q in adapter.question)


def test_unknown_or_builtin_names_are_refused_naming_the_field(demo, tmp_path):
    res = pilotrun_cli("variants", str(demo), "--set", "pilot.variants.run=[nope]", cwd=tmp_path)
    assert res.returncode == 2 and "pilot.variants.run" in res.stderr and "unknown variant 'nope'" in res.stderr
    res = pilotrun_cli("variants", str(demo), "--set", "pilot.variants.custom={bf16: {train.precision: fp16}}",
                       cwd=tmp_path)
    assert res.returncode == 2 and "'bf16' is a built-in name" in res.stderr
    res = pilotrun_cli("variants", str(demo), "--set", "pilot.variants.custom={mine: {train.nope: 1}}", cwd=tmp_path)
    assert res.returncode == 2 and "pilot.variants (mine)" in res.stderr and "train.nope" in res.stderr
    (tmp_path / "train.py").write_text("print('training')\n")
    program = write_spec(tmp_path / "prog.yaml", {"name": "p", "program": {"command": "python train.py"}})
    res = pilotrun_cli("variants", str(program), cwd=tmp_path)
    assert res.returncode == 2 and "pilots a program and has no model/data/train" in res.stderr, res.stderr


# -- the comparison (pure) ---------------------------------------------------------------------------------------

def _points(losses, norms=None, seconds=None, ids=None, scaler=None):
    norms = norms or [1.0] * len(losses)
    seconds = seconds or [0.1] * len(losses)
    return [UpdatePoint(i + 1, loss, norms[i], seconds[i], (ids or [[i]] * len(losses))[i], False,
                        None if scaler is None else scaler[i]) for i, loss in enumerate(losses)]


def test_numerics_are_compared_update_by_update_and_the_scaler_must_step_once_per_update():
    c = _points([2.0, 1.8, 1.6], norms=[1.0, 2.0, 4.0])
    v = _points([2.0, 1.9, 1.6], norms=[1.0, 3.0, 2.0], scaler=[1, 1, 1])
    n = compare_updates(c, v)
    assert n.loss_rel_diff_max == pytest.approx(0.1 / 1.8) and n.loss_rel_diff_last == 0.0
    assert n.grad_norm_ratio_last == 0.5 and n.grad_norm_ratio_range == (0.5, 1.5)
    assert n.same_examples and n.non_finite == 0 and n.scaler_skipped == 0 and n.scaler_once_per_update is True
    per_micro = compare_updates(c, _points([2.0, 1.8, 1.6], scaler=[1, 2, 1]))
    assert per_micro.scaler_once_per_update is False
    j = judge("fp16", "memory-fix", per_micro, [], 80, 100, 1.1, 1.6, 1.6, 0.02)
    assert j.verdict == "fail" and "not updated exactly once per optimizer update" in j.reason
    nan = compare_updates(c, _points([2.0, math.nan, 1.6]))
    assert nan.non_finite == 1 and nan.loss_rel_diff_max == 0.0
    # The time ratio is per interleaved round, from the first timed update: a slow moment touches both sides.
    assert time_ratio(_points([1, 1, 1, 1], seconds=[9, 9, 0.1, 0.2]),
                      _points([1, 1, 1, 1], seconds=[1, 1, 0.13, 0.26]), timed_from=3) == pytest.approx(1.3)


def test_the_verdict_says_what_was_measured_and_fails_outside_the_declared_tolerance():
    same = compare_updates(_points([2.0, 1.8]), _points([2.0, 1.8]))
    ok = judge("checkpointing", "memory-fix", same, [], 60, 100, 1.3, 1.70, 1.70, 0.02)
    assert ok.verdict == "pass" and ok.experiment == "same experiment"
    assert "peak -40% of the control's" in ok.reason and "time x1.30" in ok.reason
    off = judge("bf16", "memory-fix", same, [], 60, 100, 0.8, 1.80, 1.70, 0.02)
    assert off.verdict == "fail" and "beyond pilot.variants.val_loss_rtol 0.02" in off.reason
    near = judge("bf16", "memory-fix", same, [], 60, 100, 0.8, 1.72, 1.70, 0.02)
    assert near.verdict == "warn" and "past half the tolerance" in near.reason
    # A control that barely moved from the start cannot tell a variant that learned nothing: said, a warn.
    still = judge("bf16", "memory-fix", same, [], 60, 100, 0.8, 1.70, 1.70, 0.02, start=1.71)
    assert still.verdict == "warn" and "this check cannot tell a variant that learned nothing" in still.reason
    assert judge("bf16", "memory-fix", same, [], 60, 100, 0.8, 1.70, 1.70, 0.02, start=2.5).verdict == "pass"
    useless = judge("bf16", "memory-fix", same, [], 120, 100, 0.8, 1.70, 1.70, 0.02)
    assert useless.verdict == "warn" and "it saves no memory here" in useless.reason and "peak +20%" in useless.reason
    other = judge("short", "own", same, ["data.max_length"], 50, 100, 0.7, 1.70, 1.70, 0.02)
    assert other.verdict == "warn" and other.experiment == "different experiment: changes data.max_length"
    assert "never a memory fix" in other.reason


# -- the real run --------------------------------------------------------------------------------------------------

def test_the_demo_variants_are_measured_linked_to_the_control_and_judged(demo, tmp_path):
    ledger_path = tmp_path / "l.sqlite"
    result = run_variants(demo, ["pilot.variants.updates=5",
                                 "pilot.variants.run=[micro-batch-half, checkpointing-selective, "
                                 "checkpointing-selective-2, checkpointing, bf16, fp16]",
                                 "pilot.variants.custom={shorter: {data.max_length: 48}}"], ledger_path)
    assert [a.name for a in result.arms] == ["control", "micro-batch-half", "checkpointing-selective",
                                             "checkpointing-selective-2", "checkpointing", "bf16", "fp16", "shorter"]
    with Ledger(ledger_path) as ledger:
        run = ledger.run(result.run_id)
        rows = ledger.gate_rows(result.run_id)
        points = ledger.metrics(result.run_id)
    assert run["kind"] == RunKind.VARIANTS and run["config_hash"] == load_spec(demo).config_hash()
    assert [r["gate"] for r in rows] == [VARIANT_ROW] * 8
    control_id = rows[0]["id"]
    d = {r["details"]["variant"]: VariantDetails.of(r["details"]) for r in rows}
    by_name = {r["details"]["variant"]: r for r in rows}
    assert by_name["control"]["verdict"] == "pass" and d["control"].control_row is None
    for name in ("micro-batch-half", "checkpointing-selective", "checkpointing-selective-2", "checkpointing", "bf16",
                 "fp16", "shorter"):
        assert d[name].control_row == control_id, name
        assert d[name].updates == 5 and d[name].same_initial_weights is True, name
        assert d[name].time_ratio is not None and d[name].time_ratio > 0, name
        assert d[name].val_loss is not None and math.isfinite(d[name].val_loss), name
    # Checkpointing keeps fewer activations alive: its measured peak is below the control's; the selective policy,
    # which keeps the matmul outputs, sits between the two, and keeping one matmul in 2 (torchtitan's op policy)
    # between full checkpointing and keeping them all.
    assert d["checkpointing"].peak_live_bytes < d["checkpointing-selective-2"].peak_live_bytes < d[
        "checkpointing-selective"].peak_live_bytes < d["control"].peak_live_bytes
    for policy in ("checkpointing-selective", "checkpointing-selective-2"):   # recomputation, same values
        assert d[policy].numerics["loss_rel_diff_max"] < 1e-5, policy
    assert "time x" in by_name["checkpointing"]["reason"]
    # Micro batch /2 x accumulation x2: the same examples in every update, the same examples per update.
    assert d["micro-batch-half"].numerics["same_examples"] is True
    assert by_name["micro-batch-half"]["inputs"]["examples_per_update"] == by_name["control"]["inputs"][
        "examples_per_update"] == 16
    assert d["micro-batch-half"].numerics["loss_rel_diff_max"] < 1e-4  # token-exact accumulation
    # Lower precisions: loss differences reported with a verdict; fp16 with its scaler's skipped updates.
    for name in ("bf16", "fp16"):
        assert by_name[name]["verdict"] in ("pass", "warn", "fail") and "loss differs by up to" in by_name[name]["reason"]
        assert d[name].numerics["loss_rel_diff_max"] is not None
    assert d["fp16"].numerics["scaler_skipped"] is not None and d["fp16"].numerics["scaler_once_per_update"] is True
    assert d["bf16"].numerics["scaler_skipped"] is None
    # A shorter maximum length is another experiment, whatever it saves.
    assert d["shorter"].experiment == "different experiment: changes data.max_length"
    assert by_name["shorter"]["verdict"] in ("warn", "fail") and "never a memory fix" in by_name["shorter"]["reason"]
    # Each configuration's updates are in the ledger, memory-measured ones marked.
    control_points = [p for p in points if p["extra"]["variant"] == "control"]
    assert [p["step"] for p in control_points] == [1, 2, 3, 4, 5]
    assert [p["extra"]["memory_measured"] for p in control_points] == [True, True, False, False, False]
    # The validation loss at the shared initial weights is kept: the control moved away from it.
    assert d["control"].val_loss_start is not None and d["control"].val_loss_start > d["control"].val_loss


def test_the_command_prints_a_table_and_json(demo, tmp_path):
    res = pilotrun_cli("variants", str(demo), "--ledger", str(tmp_path / "l.sqlite"), "--set",
                       "pilot.variants.updates=5", "--set", "pilot.variants.run=[checkpointing]", "--json",
                       cwd=tmp_path)
    assert res.returncode in (0, 1), res.stderr
    out = json.loads(res.stdout)
    assert [r["details"]["variant"] for r in out["rows"]] == ["control", "checkpointing"]
    assert set(out["not_run"]) == set()
    res = pilotrun_cli("variants", str(demo), "--ledger", str(tmp_path / "l.sqlite"), "--set",
                       "pilot.variants.updates=5", "--set", "pilot.variants.run=[checkpointing]", cwd=tmp_path)
    assert "checkpointing" in res.stdout and "vs control" in res.stdout and "same experiment" in res.stdout


# -- the advisor uses what was measured (deliverable 2) -----------------------------------------------------------

def _ledger_with_variants(path, spec, device_name: str, time_ratio: float) -> str:
    from pilotrun.ledger.records import GateRow, new_run_id

    run_id = new_run_id(spec.name)
    with Ledger(path) as ledger:
        ledger.start_run(run_id, spec.name, RunKind.VARIANTS, config_hash=spec.config_hash(),
                         meta={"device": "cuda:0", "device_name": device_name})
        control = ledger.add_gate_row(run_id, GateRow.now(VARIANT_ROW, "pass", "control", details={
            "variant": "control", "time_ratio": 1.0, "peak_ratio": 1.0}))
        ledger.add_gate_row(run_id, GateRow.now(VARIANT_ROW, "pass", "checkpointing", details={
            "variant": "checkpointing", "control_row": control, "time_ratio": time_ratio, "peak_ratio": 0.58}))
        ledger.add_gate_row(run_id, GateRow.now(VARIANT_ROW, "fail", "bf16", details={
            "variant": "bf16", "control_row": control, "time_ratio": 0.5, "peak_ratio": 0.7}))
    return run_id


@pytest.mark.process
@pytest.mark.parametrize("device, applied", [("Card-16GB", True), ("cpu", False)])
def test_the_advisor_times_checkpointing_with_the_recompute_measured_on_that_accelerator(tmp_path, device, applied):
    from tests.estimate.test_estimate import EXAMPLES, SHALLOW, SMALL_CARD

    (tmp_path / "cards.yaml").write_text(SMALL_CARD)
    path = EXAMPLES / "llama-7b-estimate" / "pilot.yaml"
    run_id = _ledger_with_variants(tmp_path / "l.sqlite", load_spec(path, SHALLOW, check_files=False), device, 1.5)
    res = pilotrun_cli("estimate", str(path), "--set", SHALLOW[0], "--catalog", str(tmp_path / "cards.yaml"),
                       "--accelerator", "Card-16GB", "--strategy", "single", "--json", "--ledger",
                       str(tmp_path / "l.sqlite"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    advice = {v["variant"]: v for v in out["advice"]["Card-16GB"]}
    ac = advice["activation checkpointing"]  # full: the policy the variant "checkpointing" measured
    selective = advice["activation checkpointing (selective: matmul outputs kept)"]
    assert "measured in" not in selective["reason"]  # nothing measured that policy
    assert f"x1.50 time measured in {run_id} on {device}" in ac["reason"]
    assert f"peak x0.58 of the control's live tensors, measured in {run_id}" in ac["reason"]
    plain = out["fits"][0]  # the same job without checkpointing on the card
    if applied:  # the time is the same job's without checkpointing x the measured ratio
        assert ac["time_factor"] == pytest.approx(1.5, rel=1e-6) and "the FLOPs predicted" in ac["reason"]
        # and its training memory the same job's x the measured peak ratio (one device, the fix alone)
        assert ac["memory_source"] == "measured" and ac["device_used_bytes"] < plain["device_used_bytes"]
        assert "memory: training x0.58 of the configuration without it, as measured there, applied" in ac["reason"]
    else:  # measured on another device: quoted, the FLOPs ratio used
        assert "not applied to Card-16GB: another device" in ac["reason"]
        assert ac["time_factor"] != pytest.approx(1.5, rel=1e-3)
        assert ac["memory_source"] == "trace"
    # Sharded, or with another fix, the ratio one device measured alone does not hold: the trace's memory stands.
    assert all(v["memory_source"] == "trace" for name, v in advice.items() if "FSDP2" in name or "+" in name)


def test_a_measured_peak_replaces_the_training_stages_and_evaluation_stays_as_traced():
    from pilotrun.estimate.catalog import load_catalog
    from pilotrun.estimate.measured import with_measured_peak

    acc = load_catalog()["H100-80GB"]
    gib, ws = 2**30, acc.blas_workspace_bytes * 2

    def stage(alloc):
        return {"peak_allocated_bytes": alloc, "peak_reserved_bytes": int(alloc * 1.1),
                "device_used_bytes": int(alloc * 1.1) + acc.context_bytes, "workspace_bytes": ws}

    plain = {"stages": {"first_step": stage(60 * gib), "steady_step": stage(70 * gib), "eval": stage(20 * gib)}}
    fixed = {"stages": {"first_step": stage(50 * gib), "steady_step": stage(55 * gib), "eval": stage(45 * gib)}}
    row = with_measured_peak(plain, fixed, 0.5, acc)
    steady = row["stages"]["steady_step"]
    assert steady["peak_allocated_bytes"] == int((70 * gib - ws) * 0.5 + ws)
    saved = (70 * gib - steady["peak_allocated_bytes"]) * 1.10
    assert steady["device_used_bytes"] == int(stage(70 * gib)["device_used_bytes"] - saved)
    # Evaluation is not what the variants measured: the fix's own trace, here the row's worst stage.
    assert row["stages"]["eval"] == fixed["stages"]["eval"] and row["limiting_stage"] == "eval"
    assert row["device_used_bytes"] == fixed["stages"]["eval"]["device_used_bytes"] and row["fits"]


def test_a_policy_the_model_cannot_take_is_not_compared_and_the_rest_still_run(tmp_path, monkeypatch):
    """The toy factory's plain torch model has no checkpointing switch: its checkpointing variants are skip rows
    saying why, not failures, and bf16 is still measured."""
    from tests.conftest import TEST_DIGEST, copy_fixture

    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    toy = copy_fixture("toy", tmp_path)
    result = run_variants(toy, ["pilot.variants.updates=5", "pilot.variants.run=[checkpointing-every-2, "
                                                            "checkpointing, bf16]"], tmp_path / "l.sqlite")
    rows = {a.name: a.row.to_dict() for a in result.arms if a.row}
    assert rows["checkpointing"]["verdict"] == "skip" and "no gradient_checkpointing_enable()" in rows[
        "checkpointing"]["reason"]
    assert rows["checkpointing-every-2"]["verdict"] == "skip"
    assert rows["bf16"]["verdict"] in ("pass", "warn") and rows["control"]["verdict"] == "pass"


def test_the_advisor_reads_each_fix_from_the_newest_run_that_compared_it(tmp_path):
    from pilotrun.estimate.measured import measured_fixes
    from pilotrun.ledger.records import GateRow, new_run_id

    spec = load_spec(copy_example("tiny-sft", tmp_path))
    with Ledger(tmp_path / "l.sqlite") as ledger:
        ids = []
        for measured in ({"checkpointing": ("pass", 1.4)}, {"bf16": ("pass", 0.7), "checkpointing": ("fail", 9.0)}):
            run_id = new_run_id(spec.name)
            ids.append(run_id)
            ledger.start_run(run_id, spec.name, RunKind.VARIANTS, config_hash=spec.config_hash(),
                             meta={"device_name": "NVIDIA H100 80GB HBM3"})
            control = ledger.add_gate_row(run_id, GateRow.now(VARIANT_ROW, "pass", "control",
                                                              details={"variant": "control"}))
            for name, (verdict, ratio) in measured.items():
                ledger.add_gate_row(run_id, GateRow.now(VARIANT_ROW, verdict, name, details={
                    "variant": name, "control_row": control, "time_ratio": ratio}))
        found = measured_fixes(ledger, spec.config_hash())
    assert found is not None and set(found.fixes) == {"checkpointing", "bf16"}
    # The newer run's checkpointing failed: the older run's measurement stands, named as its own.
    assert found.fixes["checkpointing"].time_ratio == 1.4 and found.where["checkpointing"][0] == ids[0]
    assert found.where["bf16"][0] == ids[1]
    assert measured_fixes(ledger=None, config_hash=spec.config_hash()) is None


@pytest.mark.process
def test_select_and_plan_time_checkpointing_with_the_recompute_measured_on_that_accelerator(tmp_path):
    from tests.estimate.test_estimate import EXAMPLES, SHALLOW, SMALL_CARD

    (tmp_path / "cards.yaml").write_text(SMALL_CARD)
    path = EXAMPLES / "llama-7b-estimate" / "pilot.yaml"
    args = ["--set", SHALLOW[0], "--catalog", str(tmp_path / "cards.yaml"), "--accelerator", "Card-16GB", "--json"]
    predicted = json.loads(pilotrun_cli("select", str(path), *args, cwd=tmp_path).stdout)["rows"][0]
    run_id = _ledger_with_variants(tmp_path / "l.sqlite", load_spec(path, SHALLOW, check_files=False), "Card-16GB", 3.0)
    res = pilotrun_cli("select", str(path), *args, "--ledger", str(tmp_path / "l.sqlite"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    row = json.loads(res.stdout)["rows"][0]
    # On a 16 GB card the sheet needs FSDP2 x2 with checkpointing: timed with the measured recompute, said so.
    assert row["activation_checkpointing"] is True and (row["strategy"], row["gpus"]) == ("fsdp", 2)
    said = f"activation checkpointing: x3.00 time measured in {run_id} on Card-16GB, instead of the FLOPs ratio"
    assert row["measured_recompute"] == said and said in row["steps"]
    assert predicted["measured_recompute"] is None
    shown = pilotrun_cli("select", str(path), *args[:-1], "--ledger", str(tmp_path / "l.sqlite"), cwd=tmp_path)
    assert f"Card-16GB: {said}" in " ".join(shown.stdout.split())
    assert row["seconds_per_update"] > 1.5 * predicted["seconds_per_update"]
    plan = pilotrun_cli("plan", str(path), *args, "--ledger", str(tmp_path / "l.sqlite"), cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)["accelerators"][0]["configuration"]
    assert planned["seconds_per_update"] == pytest.approx(row["seconds_per_update"])
