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


KEY = bytes(range(E.KEY_BYTES))


def _signed(tmp_path, **more):
    return _active(tmp_path, **{E.EVENTS_KEY: KEY.hex(), **more})


def _forged_export(rank: int = 1) -> dict:
    """What an attacker appends: a passing export row whose manifest would become known."""
    row = {"gate": "export", "verdict": "pass", "reason": "forged", "rank": rank, "world_size": 2, "inputs": {},
           "memory": {}, "details": {"path": "/tmp/evil", "manifest_sha256": "ab" * 32},
           "started_at": "t0", "ended_at": "t1"}
    return {"kind": "gate", "rank": rank, "writer": "w", "seq": 99, "row": row}


def test_every_line_is_signed_and_a_line_without_the_runs_key_is_left_out_and_named(tmp_path):
    """Found by the adversary: one line appended to a program's events file made export and reload_eval pass rows
    that no check produced. Every line now carries an HMAC under the run's key; a line without it, with another key's,
    or edited after it was signed is left out, and each is named."""
    from pilotrun.program.runner import read_events

    job = _signed(tmp_path)
    job.update(1, loss=0.5, lr=1e-3, ids=[1, 2])
    job.record_gate("export", "fail", "the export wrote no weights")
    path = job.events_path
    lines = path.read_text().splitlines()
    assert all(E.signed_body(KEY, line) for line in lines) and len(lines) == 3  # start, update, gate
    assert [json.loads(line)["seq"] for line in lines] == [0, 1, 2]
    edited = lines[2].replace('"fail"', '"pass"')  # the same line, its verdict changed after signing
    other_key = E.sign(b"x" * E.KEY_BYTES, json.dumps(_forged_export()))
    with open(path, "a") as fh:
        fh.write("\n".join([json.dumps(_forged_export()), other_key, edited]) + "\n")
    problems: list[str] = []
    events = read_events(path, KEY, problems, rank=1)
    assert [e["kind"] for e in events] == ["start", "update", "gate"]
    assert [e["row"]["verdict"] for e in events if e["kind"] == "gate"] == ["fail"]
    assert [p.split(" line ")[1].split(" ")[0] for p in problems] == ["4", "5", "6"], problems
    assert all("is not signed with this run's key" in p for p in problems)
    assert read_events(path, None, [], rank=1) == []  # without the key (it was lost), no line is believed
    assert "mac" not in events[0]  # the event is the text that was signed


def test_a_signed_line_copied_repeated_or_removed_is_named(tmp_path):
    """Lines of this very run, moved: another rank's line in this rank's file and a line written twice are left out;
    a line removed leaves a gap in its writer's numbers, which is named."""
    from pilotrun.program.runner import read_events

    job = _signed(tmp_path)
    for update in (1, 2, 3):
        job.update(update, loss=0.5, lr=1e-3)
    other = _signed(tmp_path, RANK="0")
    other.update(1, loss=0.5, lr=1e-3)
    start, one, _removed, three = job.events_path.read_text().splitlines()
    foreign = other.events_path.read_text().splitlines()[1]
    job.events_path.write_text("\n".join([start, one, one, three, foreign]) + "\n")
    problems: list[str] = []
    events = read_events(job.events_path, KEY, problems, rank=1)
    assert [e.get("update") for e in events] == [None, 1, 3]
    assert any("line 3 repeats number 1 of its writer" in p for p in problems), problems
    assert any("1 line(s) of writer" in p and "before number 3 are missing" in p for p in problems), problems
    assert any("line 5 is rank 0's event, in rank 1's file" in p for p in problems), problems


def test_a_key_that_is_not_hex_is_named(tmp_path):
    with pytest.raises(RuntimeError, match="PILOTRUN_EVENTS_KEY hex digits"):
        _active(tmp_path, **{E.EVENTS_KEY: "not-hex"})


def test_the_live_tail_a_campaign_reads_keeps_only_signed_whole_lines(tmp_path):
    from pilotrun.program.runner import EventTail

    job = _signed(tmp_path)
    tail = EventTail(job.events_path, KEY, rank=1)
    job.update(1, loss=0.5, lr=1e-3)
    line = E.sign(KEY, json.dumps({"kind": "update", "rank": 1, "writer": "w", "seq": 0, "update": 2}))
    with open(job.events_path, "a") as fh:
        fh.write(json.dumps({"kind": "update", "rank": 1, "update": 9, "loss": 0.0}) + "\n" + line[:20])
    assert [e.get("update") for e in tail.poll()] == [None, 1]  # start, update 1; the unsigned line left out
    with open(job.events_path, "a") as fh:
        fh.write(line[20:] + "\n")  # the rest of a line that was mid-write at the last poll
    assert [e["update"] for e in tail.poll()] == [2]
    assert len(tail.problems) == 1 and "line 3 is not signed with this run's key" in tail.problems[0]


def test_a_save_numbered_unlike_the_last_update_is_said_once_on_stderr_and_still_reported(tmp_path, capsys):
    job = _active(tmp_path, **{E.SAVE_AT: ""})
    ck = tmp_path / "ck" / "u.pt"
    ck.parent.mkdir(parents=True)
    ck.write_bytes(b"x")
    job.saved(0, ck)  # the initial state, before any update: nothing to check it against
    job.update(1, loss=0.5, lr=0.1)
    job.saved(1, ck)
    assert capsys.readouterr().err == ""
    job.update(2, loss=0.4, lr=0.1)
    job.saved(3, ck)
    err = capsys.readouterr().err
    assert "pilotrun: job.saved(3) after job.update(2): saved(N) must follow update(N)" in err
    job.update(3, loss=0.3, lr=0.1)
    job.saved(5, ck)
    assert capsys.readouterr().err == ""  # said once: the pilot's row lists them all
    # The save stays an event as reported: the parent reads the order and names both numbers in the resume row.
    assert [(e["kind"], e["update"]) for e in _events(job.events_path) if e["kind"] in ("update", "saved")] == [
        ("saved", 0), ("update", 1), ("saved", 1), ("update", 2), ("saved", 3), ("update", 3), ("saved", 5)]
