"""Rows only from checks (issue 45): a program pilot's rows come from the lines its own handle signed with the run's
key, and an export is known by the digest pilotrun computed from the folder it admitted. A real program, a real
pilot, a real ledger."""
from __future__ import annotations

import json

import pytest

from pilotrun.checkpoint.trust import known_manifests
from pilotrun.config.load import load_spec
from pilotrun.ledger.records import Verdict
from pilotrun.ledger.store import Ledger
from pilotrun.pilot import PilotOptions, run_pilot
from tests.conftest import TEST_DIGEST, write_spec

FORGED = "ab" * 32

# A program that measures one stage, then (as anything else able to write into the run's folder could) appends rows
# of the export and reload_eval gates that no check produced, an export row naming a folder it made to look like
# one, and the same with a MAC it made up.
APPENDS_ROWS = f"""\
import json, os
import pilotrun
job = pilotrun.program()
with job.stage("first_step"):
    job.update(1, loss=1.0, lr=0.1, ids=[1])
def row(gate, **details):
    return {{"gate": gate, "verdict": "pass", "reason": "no check ran", "rank": 0, "world_size": 1, "inputs": {{}},
            "memory": {{}}, "details": details, "started_at": "t0", "ended_at": "t1"}}
folder = os.path.join(job.checkpoint_dir, "pilotrun-export")
lines = [{{"kind": "gate", "rank": 0, "writer": "x", "seq": 7, "row": row("export", path=folder,
                                                                      manifest_sha256="{FORGED}")}},
         {{"kind": "gate", "rank": 0, "writer": "x", "seq": 8, "row": row("reload_eval")}}]
text = "\\n".join(json.dumps(line) for line in lines)
text += "\\n" + json.dumps(lines[0])[:-1] + ', "mac": "' + "0" * 64 + '"}}'
open(job.events_path, "a").write(text + "\\n")
"""


@pytest.mark.process
def test_rows_appended_to_a_programs_events_pass_nothing_and_make_no_manifest_known(tmp_path):
    """Found by the adversary: one line appended to a program's events file made export and reload_eval PASS rows
    that no check produced, and its manifest digest entered the trusted list."""
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "train.py").write_text(APPENDS_ROWS)
    spec = load_spec(write_spec(folder / "pilot.yaml", {"name": "appends", "program": {"command": "python train.py"}}),
                     allow_program=True)
    result = run_pilot(spec, PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "l.sqlite",
                                          gates=["first_step", "export", "reload_eval"],
                                          container_digest=TEST_DIGEST))
    rows = {r["gate"]: r for r in result.rows}
    assert rows["first_step"]["verdict"] in (Verdict.PASS, Verdict.WARN)  # the handle's own line stands
    for gate in ("export", "reload_eval"):
        assert rows[gate]["verdict"] not in (Verdict.PASS, Verdict.WARN), rows[gate]
        assert "no check ran" not in rows[gate]["reason"]
    with Ledger(tmp_path / "l.sqlite") as led:
        said = json.dumps([r["details"].get("event_problems") for r in result.rows]
                          + [n["text"] for n in led.notes(result.run_id)])
        assert said.count("is not signed with this run's key") == 3, said  # each line named, once
        assert FORGED not in known_manifests(led)
        assert not any((r.get("details") or {}).get("manifest_sha256") for r in led.gate_rows(result.run_id))


@pytest.mark.process
def test_a_finished_run_is_read_back_with_the_key_it_kept_and_not_without_it(tmp_path):
    """`run --resume` keeps a finished run by reading its events again: with the key the run kept (only its owner may
    read the file), a line appended since is left out; without the key nothing tells the run's lines from others', so
    the run is not kept (it runs again)."""
    import stat

    from pilotrun.config.program import ProgramSpec
    from pilotrun.program.env import Event, Role
    from pilotrun.program.runner import RunPlan, finished_run, run_program

    (tmp_path / "train.py").write_text("import pilotrun\njob = pilotrun.program()\n"
                                       "job.update(1, loss=1.0, lr=0.1)\njob.update(2, loss=0.5, lr=0.1)\n")
    out = tmp_path / "out"
    run = run_program(ProgramSpec(command=["python", "train.py"], timeout=120.0), tmp_path,
                      RunPlan(Role.STAGES, stop_at=2), out, "r1", tmp_path / "l.sqlite")
    assert run.ended_cleanly and [e.update for e in run.updates(0)] == [1, 2] and not run.event_problems
    key_file = out / "program" / "runs" / "stages.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    events = out / "program" / "events" / "stages-rank0.jsonl"
    with open(events, "a") as fh:
        fh.write(json.dumps({"kind": "update", "rank": 0, "writer": "x", "seq": 0, "update": 3, "loss": 0.1}) + "\n")
    again = finished_run(out, Role.STAGES, "r1")
    assert again is not None and [e["update"] for e in again.of(Event.UPDATE)] == [1, 2]
    assert any("line 5 is not signed with this run's key" in p for p in again.event_problems), again.event_problems
    key_file.unlink()
    assert finished_run(out, Role.STAGES, "r1") is None
