"""The program handle (pilotrun.program()): inert outside a pilot, every reported value validated into an event."""
from __future__ import annotations

import json
import math

import pytest
import torch

import pilotrun
from pilotrun.program import ProgramHandle, Role
from pilotrun.program import env as E


def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _active(tmp_path, role=Role.CONTROL, **more):
    environ = {E.PROGRAM: "1", E.ROLE: str(role), E.RUN_ID: "r1", E.EVENTS: str(tmp_path / "ev"),
               E.CHECKPOINT_DIR: str(tmp_path / "ck"), E.SAVE_AT: "2", E.STOP_AT: "4", "RANK": "1", "WORLD_SIZE": "2",
               **more}
    return ProgramHandle(environ)


def test_inert_outside_a_pilot(tmp_path):
    job = ProgramHandle({})
    assert (job.active, job.role, job.resume_from, job.checkpoint_dir) == (False, "", None, None)
    assert not job.should_save(2) and not job.should_stop(10**6)
    job.update(1, loss=float("nan"), lr=0.1, ids="bad")  # no-op, no raise
    job.saved(1, tmp_path / "missing")
    job.record_gate("inspect", "pass", "x")
    with job.stage("first_step") as st:
        assert st.name == "first_step"
    assert job.events_path is None
    assert isinstance(pilotrun.program(), ProgramHandle) and pilotrun.program() is pilotrun.program()


def test_active_reads_the_environment(tmp_path):
    job = _active(tmp_path, role=Role.RESUMED, **{E.RESUME_FROM: str(tmp_path / "ck" / "u2")})
    assert job.active and job.role == Role.RESUMED and job.rank == 1 and job.world_size == 2
    assert job.resume_from == str(tmp_path / "ck" / "u2") and job.checkpoint_dir == str(tmp_path / "ck")
    assert [u for u in range(1, 6) if job.should_save(u)] == [2]
    assert [u for u in range(1, 6) if job.should_stop(u)] == [4, 5]
    assert job.events_path == tmp_path / "ev" / "resumed-rank1.jsonl"


def test_updates_are_validated_into_problems_not_exceptions(tmp_path):
    job = _active(tmp_path)
    job.update(1, loss=torch.tensor(0.5), lr=1e-3, grad_norm=torch.tensor(2.0), ids=torch.tensor([3, 4]), tokens=7)
    job.update(1, loss=0.4, lr=1e-3)                      # not increasing
    job.update(2, loss=float("nan"), lr=1e-3, ids=[1.5])  # nan loss, float ids
    job.update(3, loss="0.3", lr=None, ids="abc", bad=object())
    job.update(4, loss=torch.ones(3), lr=1e-3, ids=torch.tensor([0.5]))
    ev = _events(job.events_path)
    assert ev[0]["kind"] == "start" and ev[0]["world_size"] == 2
    updates = [e for e in ev if e["kind"] == "update"]
    problems = [(e["update"], e["field"]) for e in ev if e["kind"] == "problem"]
    assert [u["update"] for u in updates] == [1, 2, 3, 4]
    first = updates[0]
    assert (first["loss"], first["lr"], first["grad_norm"], first["ids"], first["extra"]) == (0.5, 1e-3, 2.0, [3, 4],
                                                                                              {"tokens": 7.0})
    assert problems == [(1, "update"), (2, "loss"), (2, "ids"), (3, "loss"), (3, "lr"), (3, "ids"),
                        (3, "extra.bad"), (4, "loss"), (4, "ids")]
    nan = next(e for e in ev if e["kind"] == "problem" and e["field"] == "loss")
    assert nan["non_finite"] and math.isnan(float(updates[1]["loss"]))


def test_stage_saved_and_record_gate_stream_rows(tmp_path):
    job = _active(tmp_path)
    model = torch.nn.Linear(4, 4)
    with job.stage("first_step", inputs={"micro_batch_size": 2}, track=[model]):
        model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(ZeroDivisionError), job.stage("eval"):
        raise ZeroDivisionError("division by zero")
    ck = tmp_path / "ck" / "u2.pt"
    ck.parent.mkdir(parents=True)
    ck.write_bytes(b"x")
    job.saved(2, ck)
    job.saved(3, tmp_path / "nowhere")
    job.record_gate("inspect", "warn", "labels not masked", examples=2)
    job.record_gate("batch", "maybe", "x")
    ev = _events(job.events_path)
    stages = [e["row"] for e in ev if e["kind"] == "stage"]
    assert [(r["gate"], r["verdict"], r["rank"]) for r in stages] == [("first_step", "pass", 1), ("eval", "fail", 1)]
    assert stages[0]["inputs"]["role"] == "control" and stages[0]["seconds"] >= 0
    assert "ZeroDivisionError" in stages[1]["reason"]
    assert [e["path"] for e in ev if e["kind"] == "saved"] == [str(ck.resolve())]
    gates = [e["row"] for e in ev if e["kind"] == "gate"]
    assert [(g["gate"], g["verdict"], g["details"]["examples"]) for g in gates] == [("inspect", "warn", 2)]
    assert [e["field"] for e in ev if e["kind"] == "problem"] == ["saved", "record_gate('batch')"]


def test_a_hand_set_environment_that_pilotrun_would_not_set_is_named(tmp_path):
    with pytest.raises(RuntimeError, match="PILOTRUN_ROLE must be one of control"):
        _active(tmp_path, **{E.ROLE: "boss"})
    with pytest.raises(RuntimeError, match="PILOTRUN_PROGRAM"):
        _active(tmp_path, **{E.STOP_AT: "four"})
