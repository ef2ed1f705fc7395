"""The pilot reads the gates' declarations: capabilities a driver lacks, rows --resume keeps, failure kinds."""
from __future__ import annotations

import json
import types
from pathlib import Path

import torch

from pilotrun import strategies
from pilotrun.checkpoint.io import AtomicFolder
from pilotrun.distributed import DistEnv
from pilotrun.drivers import Capability, JobProcess, LoopDriver
from pilotrun.gates import PilotContext, registry
from pilotrun.gates.save import expect_path
from pilotrun.ledger.records import Failure, GateRow
from pilotrun.pilot import ResumePlan, carry_rows
from tests.conftest import gate_rows


def _ctx(tmp_path: Path, spec=None, restore_from: Path | None = None) -> PilotContext:
    process = JobProcess(torch.device("cpu"), "test", "cpu", DistEnv(), strategies.get("single"))
    return PilotContext(spec=spec, run_id="r", out_dir=tmp_path, process=process, restore_from=restore_from)


def _row(gate: str, **details) -> GateRow:
    return GateRow.now(gate, "pass", "ok", details=details)


def test_a_driver_without_a_capability_gets_those_gates_skipped_with_the_reason(toy, tmp_path, monkeypatch):
    from pilotrun.drivers import build

    class NoExport(LoopDriver):
        """The loop, declaring it cannot write an inference artifact."""

        name = "no-export"
        capabilities = frozenset({Capability.UPDATES, Capability.MODEL, Capability.FULL_STATE, Capability.RESTART})

    class NoModel(NoExport):
        """... nor give its model to this process (like a user's own program)."""

        name = "no-model"
        capabilities = frozenset({Capability.UPDATES, Capability.FULL_STATE, Capability.RESTART})

    from pilotrun.config.spec import JobKind

    monkeypatch.setitem(build.DRIVERS, JobKind.LOOP, NoExport)  # the spec's kind now gets this driver
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    rows = gate_rows(toy, tmp_path / "a", gates=["first_step", "export", "reload_eval"])
    assert rows["first_step"]["verdict"] == "pass"
    assert rows["export"]["verdict"] == "skip"
    assert rows["export"]["reason"] == "not measured: the no-export driver cannot write an inference artifact"
    # The gate after it names the root cause as not measured, not as a failure.
    assert rows["reload_eval"]["verdict"] == "skip"
    assert rows["reload_eval"]["reason"] == ("skipped: export was not measured (not measured: the no-export driver "
                                             "cannot write an inference artifact)")
    monkeypatch.setitem(build.DRIVERS, JobKind.LOOP, NoModel)
    rows = gate_rows(toy, tmp_path / "b", gates=["first_step", "eval"])
    assert rows["load"]["verdict"] == "pass"
    for gate in ("first_step", "eval"):
        assert rows[gate]["verdict"] == "skip"
        assert rows[gate]["reason"] == ("not measured: the no-model driver cannot give the model, its batches and "
                                        "its loss normalisation to this process")


def test_resume_carries_a_row_only_with_the_rows_it_rests_on(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-000001"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    export = tmp_path / "export"
    with AtomicFolder(export, "export") as folder:  # a real artifact: a carried export must match its manifest
        folder.write_json("export.json", {"format": "test"})
    assert folder.manifest_sha256 is not None
    rows = {"inspect": _row("inspect"),  # an old row without its scan: inspect runs again, and so does batch
            "split": _row("split"), "batch": _row("batch"), "first_step": _row("first_step"),
            "steady_step": _row("steady_step"), "save": _row("save"), "restore": _row("restore"),
            "export": _row("export", path=str(export)), "lock": _row("lock")}
    # An export row that did not record its manifest's hash is not carried: nothing says the folder is the same.
    assert "export" not in carry_rows(ResumePlan("parent", ckpt, rows), list(registry.GATES),
                                      _ctx(tmp_path, restore_from=ckpt))
    rows["export"] = _row("export", path=str(export), manifest_sha256=folder.manifest_sha256)
    plan = ResumePlan("parent", ckpt, rows)
    ctx = _ctx(tmp_path, restore_from=ckpt)
    carried = carry_rows(plan, list(registry.GATES), ctx)
    # No fingerprints beside the checkpoint: save runs again, so restore (which reads its product) does too.
    assert sorted(carried) == ["export", "first_step", "split", "steady_step"]
    assert ctx.export_dir == export and ctx.checkpoint is None and ctx.scan is None and ctx.first_update == 1
    expect_path(ckpt).write_text("{}")
    rows["inspect"] = _row("inspect", scan={"examples": 3})
    ctx = _ctx(tmp_path, restore_from=ckpt)
    carried = carry_rows(ResumePlan("parent", ckpt, rows), list(registry.GATES), ctx)
    assert sorted(carried) == ["batch", "export", "first_step", "inspect", "restore", "save", "split",
                               "steady_step"]  # lock and load always run again
    assert ctx.checkpoint is not None and ctx.checkpoint.folder == ckpt and ctx.scan == {"examples": 3}


def test_a_fail_row_says_what_kind_of_failure_it_is(toy, tmp_path):
    rows = gate_rows(toy, tmp_path, "model.bug=eval_oom", gates=["eval"])
    assert rows["eval"]["details"]["failure"] == Failure.OUT_OF_MEMORY
    rows = gate_rows(toy, tmp_path, "model.bug=inf_loss", gates=["first_step"])
    assert rows["first_step"]["details"]["failure"] == Failure.NON_FINITE


def test_the_float64_explanation_is_only_given_on_the_float64_path(toy, tmp_path, monkeypatch):
    # Too little memory for a float64 copy: the check runs in float32 on the device. A RuntimeError mentioning
    # "Double" there is the model's own error, not "the model does not run in float64" (an operator-precedence
    # bug once said so).
    monkeypatch.setattr("pilotrun.gates.accum.psutil.virtual_memory", lambda: types.SimpleNamespace(available=0))
    rows = gate_rows(toy, tmp_path, "model.bug=eval_double", gates=["accum_equivalence"])
    row = rows["accum_equivalence"]
    assert row["verdict"] == "fail"
    assert row["reason"].startswith("RuntimeError: expected scalar type Double but found Float"), row["reason"]
    assert "float64" not in row["reason"] and json.dumps(row["details"]["failure"]) == '"error"'
