"""``pilotrun run --resume`` of an interrupted program pilot (issue 20, 3): the runs of the program it finished are
kept as they ended, the rest run now, as a new run linked to the interrupted one; a changed program is refused.

A real `pilotrun run` subprocess is stopped with SIGINT while the program's resumed run waits (the program holds
while a file exists), then continued with --resume."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from pilotrun.ledger import Ledger
from tests.conftest import EXAMPLES, TEST_DIGEST, interrupt_when, pilotrun_cli, write_spec

HOLD = '''
import os, time
if job.role == "resumed":
    while os.path.exists("hold"):  # the test stops the pilot here, then removes it
        time.sleep(0.05)
'''


def _spec(tmp_path: Path) -> Path:
    folder = tmp_path / "prog"
    shutil.copytree(EXAMPLES / "own-loop", folder, ignore=shutil.ignore_patterns("__pycache__", "checkpoints"))
    src = (folder / "train.py").read_text()
    marker = "job = pilotrun.program()  # pilotrun: inert when run without pilotrun\n"
    assert marker in src
    (folder / "train.py").write_text(src.replace(marker, marker + HOLD))
    (folder / "hold").write_text("")
    return write_spec(folder / "pilot.yaml", {"name": "prog", "program": {"command": "python train.py --updates 12",
                                                                          "timeout": 120},
                                              "pilot": {"resume": {"before": 2, "after": 2}}})


@pytest.mark.process
def test_an_interrupted_program_pilot_resumes_keeping_its_finished_runs(tmp_path):
    spec = _spec(tmp_path)
    ledger = tmp_path / "ledger.sqlite"
    first_out = tmp_path / "first"
    cmd = [sys.executable, "-m", "pilotrun", "run", str(spec), "--gates", "lock,resume", "--ledger", str(ledger),
           "--out", str(first_out)]
    env = {**__import__("os").environ, "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST, "COLUMNS": "200"}
    # Stopped once the resumed run began: the control and interrupted runs are done.
    code, out = interrupt_when(cmd, (first_out / "program" / "events" / "resumed-rank0.jsonl").exists, tmp_path, env)
    assert code == 130, out
    assert "--resume" in out and "keeping the runs of the program it finished" in out
    with Ledger(ledger) as led:
        [parent] = led.runs("prog")
    assert parent["status"] == "interrupted"
    assert json.loads((first_out / "program" / "runs" / "interrupted.json").read_text())["killed"] is True

    (spec.parent / "hold").unlink()
    second_out = tmp_path / "second"
    res = pilotrun_cli("run", str(spec), "--gates", "lock,resume", "--resume", "--ledger", str(ledger), "--out",
                       str(second_out), cwd=tmp_path, env={"PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "its finished runs are kept as they ended: control" in res.stdout and "interrupted" in res.stdout
    # Only the resumed run ran again; it continued from the interrupted run's checkpoint in the first folder.
    assert sorted(p.name for p in (second_out / "program" / "events").glob("*.jsonl")) == ["resumed-rank0.jsonl"]
    with Ledger(ledger) as led:
        child = next(r for r in led.runs("prog") if r["run_id"] != parent["run_id"])
        rows = {r["gate"]: r for r in led.gate_rows(child["run_id"])}
    assert child["parent_id"] == parent["run_id"] and child["status"] == "pass"
    assert rows["resume"]["verdict"] == "pass" and "equal the control's" in rows["resume"]["reason"]
    details = json.dumps(rows["resume"]["details"])
    assert str(first_out / "program" / "checkpoints" / "interrupted") in details, details  # the first pilot's save

    # A program edited since is a config change: refused, naming the file, nothing run.
    (spec.parent / "train.py").write_text((spec.parent / "train.py").read_text() + "\n# edited\n")
    refused = pilotrun_cli("run", str(spec), "--gates", "lock,resume", "--resume", parent["run_id"], "--ledger",
                           str(ledger), "--out", str(tmp_path / "third"), cwd=tmp_path,
                           env={"PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST})
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "the program changed since run" in refused.stderr and "train.py" in refused.stderr
    assert not list((tmp_path / "third").glob("**/*"))  # nothing ran
