"""The program driver on recorded runs (no process started): how each gate's ``on_program`` declaration becomes
rows, which run records, where the program's invalid values go, and what goes into the run's notes."""
from __future__ import annotations

from pathlib import Path

import pytest

from pilotrun.config.load import load_spec
from pilotrun.drivers import DRIVERS, OnProgram, ProgramDriver, RunSite, build_driver, driver_class, join_job
from pilotrun.gates.registry import BY_NAME, GATE_NAMES, GATES
from pilotrun.ledger.records import GateRow, Verdict
from pilotrun.program.env import Role
from pilotrun.program.runner import RunOutcome
from tests.conftest import write_spec


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
    # The mean of the stages after the tracked first one (0.4, 0.3); the largest peak of all three.
    assert steady[1].seconds == pytest.approx(0.35) and steady[1].memory["peak_allocated_bytes"] == 50
    assert steady[1].details["seconds_each"] == [0.2, 0.4, 0.3] and steady[1].details["median_seconds"] == 0.35
    assert steady[1].details["seconds_per_update"] == pytest.approx(0.35)  # a stage per update: one update each
    assert steady[0].verdict == Verdict.FAIL and "loss is nan" in steady[0].reason  # rank 0's problem, on its row
    assert steady[1].verdict == Verdict.PASS
    (inspect,) = driver.proven_rows(BY_NAME["inspect"])
    assert (inspect.verdict, inspect.reason) == (Verdict.WARN, "recorded by an integration")
    (load,) = driver.proven_rows(BY_NAME["load"])  # no stage of its name reported: the line to add
    assert load.verdict == Verdict.SKIP and load.reason.startswith("not measured: the program reported no 'load' stage")
    (batch,) = driver.proven_rows(BY_NAME["batch"])
    assert batch.verdict == Verdict.SKIP and "the transformers or Lightning Trainer callback" in batch.reason


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


# -- rows only from checks: an export's manifest digest is pilotrun's own ---------------------------------------------

def _row(gate: str, verdict: str = "pass", **details) -> dict:
    return {"kind": "gate", "rank": 0, "row": {"gate": gate, "verdict": verdict, "reason": f"{gate} as recorded",
                                               "rank": 0, "world_size": 1, "inputs": {}, "details": details,
                                               "memory": {}, "started_at": "t0", "ended_at": "t1"}}


def _export(folder: Path) -> str:
    from pilotrun.checkpoint.io import AtomicFolder

    with AtomicFolder(folder, "export") as written:
        written.write_bytes("model.safetensors", b"weights" * 100)
        written.write_json("config.json", {"hidden": 4})
    assert written.manifest_sha256 is not None
    return written.manifest_sha256


def _export_rows(tmp_path: Path, path: Path, reported: str, stage_sha: str | None = None) -> dict[str, GateRow]:
    """The export, reload_eval and first_step rows a driver makes of a recording run whose export row names ``path``
    with the manifest sha256 ``reported``; written to a real ledger, as the pilot writes them."""
    from pilotrun.ledger.records import RunKind
    from pilotrun.ledger.store import Ledger

    driver = _driver(tmp_path, ["first_step", "export", "reload_eval"])
    recording = _recording(Role.STAGES, tmp_path, [_row("export", path=str(path), manifest_sha256=reported),
                                                   _row("reload_eval", max_abs_difference=0.0)])
    recording.log = tmp_path / "out" / "program" / "stages.log"  # where run_program puts it: beside checkpoints/
    if stage_sha is not None:
        recording.events[0][0]["row"]["details"] = {"manifest_sha256": stage_sha}
    driver.runs[Role.STAGES] = recording
    rows = {g: driver.proven_rows(BY_NAME[g])[0] for g in ("export", "reload_eval", "first_step")}
    with Ledger(tmp_path / "l.sqlite") as led:
        led.start_run("r1", "prog", RunKind.PILOT)
        for row in rows.values():
            led.add_gate_row("r1", row)
    return rows


def _known(tmp_path: Path) -> set[str]:
    from pilotrun.checkpoint.trust import known_manifests
    from pilotrun.ledger.store import Ledger

    with Ledger(tmp_path / "l.sqlite") as led:
        return known_manifests(led)


def test_an_export_the_program_recorded_is_known_by_the_digest_pilotrun_computed_itself(tmp_path):
    folder = tmp_path / "out" / "program" / "checkpoints" / "stages" / "pilotrun-export"
    digest = _export(folder)
    rows = _export_rows(tmp_path, folder, digest, stage_sha="cd" * 32)
    assert rows["export"].verdict == Verdict.PASS and rows["export"].details["manifest_sha256"] == digest
    assert rows["reload_eval"].verdict == Verdict.PASS
    # A stage row's own manifest_sha256 is the program's word: kept as what it reported, never known.
    stage = rows["first_step"].details
    assert stage["reported_manifest_sha256"] == "cd" * 32 and "manifest_sha256" not in stage
    assert _known(tmp_path) == {digest}


@pytest.mark.parametrize("case", ["forged digest", "outside", "edited file", "no folder"])
def test_an_export_row_pilotrun_cannot_check_fails_and_makes_nothing_known(tmp_path, case):
    """Found by the adversary: a passing export row appended to the events made its manifest digest trusted. The row
    is pilotrun's only where pilotrun admitted the folder itself; otherwise it fails, and reload_eval with it."""
    inside = tmp_path / "out" / "program" / "checkpoints" / "stages" / "pilotrun-export"
    folder = tmp_path / "elsewhere" / "export" if case == "outside" else inside
    digest = _export(folder) if case != "no folder" else "ab" * 32
    if case == "edited file":
        (folder / "model.safetensors").write_bytes(b"WEIGHTS" * 100)  # the same size, other bytes
    rows = _export_rows(tmp_path, folder, "ab" * 32 if case == "forged digest" else digest)
    export, reload = rows["export"], rows["reload_eval"]
    assert export.verdict == Verdict.FAIL and export.reason.startswith("pilotrun's own check of the export")
    assert "manifest_sha256" not in export.details and export.details["reported_manifest_sha256"]
    said = {"forged digest": "the row reported abababababab", "outside": "outside the run's checkpoint folder",
            "edited file": "model.safetensors does not match", "no folder": "manifest.json is missing"}[case]
    assert said in export.reason, export.reason
    assert reload.verdict == Verdict.FAIL and reload.reason.startswith("the export it reloaded did not pass")
    assert _known(tmp_path) == set()


def test_several_steady_stages_give_the_mean_per_update_as_the_loops_row_does():
    from pilotrun.drivers.program import combine
    rows = [_stage("steady_step", 0, s, 10)["row"] for s in (9.0, 3.0, 1.0)]
    rows[0]["details"] = {"seconds_per_update": 3.0, "updates_timed": 3}  # tracked: slower, left out of the time
    rows[1]["details"] = {"seconds_per_update": 1.0, "updates_timed": 3, "update_seconds": [1.0, 1.0, 1.0]}
    rows[2]["details"] = {"seconds_per_update": 1.0 / 3, "updates_timed": 3}
    row = combine("steady_step", [GateRow.from_mapping(r) for r in rows])
    assert row.seconds == 2.0 and row.reason.startswith("3 stages: mean 2")
    assert row.details["seconds_per_update"] == pytest.approx(4.0 / 6)  # every timed update weighs the same
    assert row.details["median_seconds_per_update"] == pytest.approx(2.0 / 3) and row.details["updates_timed"] == 6
    assert "update_seconds" not in row.details  # one stage's list would not match the combined figure
    evals = combine("eval", [GateRow.from_mapping(_stage("eval", 0, s, 10)["row"]) for s in (9.0, 3.0, 1.0)])  # a mean, no per update
    assert evals.seconds == 2.0 and "seconds_per_update" not in evals.details
