"""The program driver on recorded runs (no process started): how each gate's ``on_program`` declaration becomes
rows, which run records, where the program's invalid values go, and what goes into the run's notes."""
from __future__ import annotations

from pathlib import Path

import pytest

from pilotrun.config.load import load_spec
from pilotrun.drivers import DRIVERS, OnProgram, ProgramDriver, RunSite, build_driver, driver_class, join_job
from pilotrun.gates.registry import BY_NAME, GATE_NAMES, GATES
from pilotrun.ledger.records import Verdict
from pilotrun.program.env import Role
from pilotrun.program.runner import RunOutcome

from .conftest import write_spec


def _spec(tmp_path: Path):
    (tmp_path / "train.py").write_text("print('never run here')\n")
    return load_spec(write_spec(tmp_path / "pilot.yaml", {"name": "prog", "program": {"command": "python train.py"}}),
                     allow_program=True)


def _stage(gate: str, rank: int, seconds: float, peak: int, verdict: str = "pass") -> dict:
    row = {"gate": gate, "verdict": verdict, "reason": f"{gate} {seconds}", "seconds": seconds, "rank": rank,
           "world_size": 2, "inputs": {}, "details": {}, "memory": {"peak_allocated_bytes": peak},
           "started_at": "t0", "ended_at": "t1"}
    return {"kind": "stage", "rank": rank, "row": row}


def _recording(role: Role, tmp_path: Path, extra: list[dict] | None = None) -> RunOutcome:
    events = {rank: [_stage("first_step", rank, 0.5, 10), _stage("first_step", rank, 0.7, 30),
                     _stage("steady_step", rank, 0.2, 20), _stage("steady_step", rank, 0.4, 50),
                     _stage("steady_step", rank, 0.3, 40)] for rank in (0, 1)}
    events[0] += extra or []
    return RunOutcome(role, 0, 1.0, tmp_path / f"{role}.log", events=events)


def _driver(tmp_path: Path, gates: list[str]) -> ProgramDriver:
    spec = _spec(tmp_path)
    driver = build_driver(spec, None, join_job(spec), site=RunSite("r1", tmp_path / "out", tmp_path / "l.sqlite"))
    assert isinstance(driver, ProgramDriver)
    driver.prepare([BY_NAME[g] for g in gates], GATE_NAMES)
    return driver


def test_a_program_spec_asks_for_the_program_driver_built_from_the_spec_alone(tmp_path):
    spec = _spec(tmp_path)
    assert driver_class(spec) is ProgramDriver and DRIVERS["program"] is ProgramDriver
    assert not ProgramDriver.in_process and DRIVERS["loop"].in_process
    process = join_job(spec)  # the pilot is one process: the program launches its own ranks
    assert not process.env.active and process.device.type == "cpu"


def test_the_recording_run_is_the_control_with_the_resume_gate_and_values_go_on_the_last_update_stage(tmp_path):
    with_resume = _driver(tmp_path, ["lock", "first_step", "steady_step", "resume"])
    assert with_resume.resume_selected and with_resume.problems_gate is None
    without = _driver(tmp_path, ["lock", "first_step", "steady_step"])
    assert not without.resume_selected and without.problems_gate == "steady_step"
    assert _driver(tmp_path, ["load", "first_step"]).problems_gate == "first_step"
    assert _driver(tmp_path, ["load", "eval"]).problems_gate is None


def test_each_declaration_becomes_its_rows(tmp_path):
    driver = _driver(tmp_path, ["lock", "first_step", "steady_step", "inspect", "split"])
    recorded = {"gate": "inspect", "verdict": "warn", "reason": "recorded by an integration", "rank": 0,
                "world_size": 2, "inputs": {}, "details": {}, "memory": {}, "started_at": "t0", "ended_at": "t1"}
    problem = {"kind": "problem", "rank": 0, "update": 3, "field": "loss", "problem": "loss is nan",
               "non_finite": True}
    driver.runs[Role.STAGES] = _recording(Role.STAGES, tmp_path, [{"kind": "gate", "row": recorded}, problem])
    assert driver.proven_rows(BY_NAME["lock"]) is None  # PILOT: runs in the pilot's own process
    (split,) = driver.proven_rows(BY_NAME["split"])
    assert split.verdict == Verdict.SKIP and split.reason.startswith("not measured on a program: the program splits")
    assert split.details["on_program"] == str(OnProgram.NEVER)
    first = driver.proven_rows(BY_NAME["first_step"])
    assert [(r.rank, r.seconds) for r in first] == [(0, 0.5), (1, 0.5)]  # the first of two kept, not combined
    assert first[0].details["note"] == "2 first_step stages reported; the first is kept"
    steady = {r.rank: r for r in driver.proven_rows(BY_NAME["steady_step"])}
    assert steady[1].seconds == 0.3 and steady[1].memory["peak_allocated_bytes"] == 50  # median time, largest peak
    assert steady[0].verdict == Verdict.FAIL and "loss is nan" in steady[0].reason  # rank 0's problem, on its row
    assert steady[1].verdict == Verdict.PASS
    (inspect,) = driver.proven_rows(BY_NAME["inspect"])
    assert (inspect.verdict, inspect.reason) == (Verdict.WARN, "recorded by an integration")
    (load,) = driver.proven_rows(BY_NAME["load"])  # no stage of its name reported: the line to add
    assert load.verdict == Verdict.SKIP and load.reason.startswith("not measured: the program reported no 'load' stage")
    (batch,) = driver.proven_rows(BY_NAME["batch"])
    assert batch.verdict == Verdict.SKIP and "transformers or Lightning integration" in batch.reason


def test_the_notes_name_what_went_on_no_row(tmp_path):
    driver = _driver(tmp_path, ["lock", "eval"])
    odd = {"gate": "warmup", "verdict": "pass", "reason": "", "rank": 0, "world_size": 1, "inputs": {},
           "details": {}, "memory": {}, "started_at": "t0", "ended_at": "t1"}
    problem = {"kind": "problem", "rank": 0, "update": 2, "field": "lr", "problem": "lr not given"}
    driver.runs[Role.STAGES] = _recording(Role.STAGES, tmp_path, [{"kind": "gate", "row": odd}, problem])
    notes = driver.notes()
    assert notes[0] == "invalid values the program reported: update 2: lr not given"
    assert notes[1].startswith("the program recorded rows for unknown gate(s) ['warmup']; known: lock, inspect")
    assert len(GATES) == len(driver.known)


@pytest.mark.process
def test_a_campaign_runs_share_of_the_cores_reaches_the_program_unless_its_env_sets_its_own(tmp_path):
    """RunPlan.threads becomes the program's OMP_NUM_THREADS / MKL_NUM_THREADS (torchrun passes a value it is given
    on to every rank); a variable the spec's program.env sets is the user's choice and stays."""
    import sys

    from pilotrun.config.program import ProgramSpec
    from pilotrun.program.runner import RunPlan, run_program

    show = "import os; print('threads', os.environ.get('OMP_NUM_THREADS'), os.environ.get('MKL_NUM_THREADS'))"
    program = ProgramSpec(command=[sys.executable, "-c", show], env={"MKL_NUM_THREADS": "7"})
    run_program(program, tmp_path, RunPlan(Role.CAMPAIGN, threads=3, timeout=60), tmp_path / "out", "r1",
                tmp_path / "l.sqlite")
    assert "threads 3 7" in (tmp_path / "out" / "program" / f"{Role.CAMPAIGN}.log").read_text()
