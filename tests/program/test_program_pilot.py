"""Piloting a user's own program: the program spec, the example loop standalone, planted resume defects caught by
the resume gate (real processes, real SIGKILL), and the example under real torchrun with 2 gloo processes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pilotrun.cli import main
from pilotrun.config.load import ProgramSpecRefused, load_spec
from pilotrun.config.schema import SpecError
from pilotrun.config.spec import ProgramOnlySpec
from pilotrun.ledger.records import Failure, GateRow, Verdict
from pilotrun.ledger.store import Ledger
from pilotrun.pilot import PilotOptions, run_pilot
from pilotrun.program.compare import Cause, CompareChoice, CompareMode
from pilotrun.program.env import Event, Role
from pilotrun.program.resume import resume_rows
from pilotrun.program.runner import RunOutcome
from tests.conftest import EXAMPLES, TEST_DIGEST, copy_fixture, planted_example, write_spec

EXACT = CompareChoice(CompareMode.BITWISE, 0.0, "program.compare: bitwise")

REPO = Path(__file__).resolve().parents[2]


def _program(tmp_path: Path, patches: dict[str, str] | None = None, command: str = "python train.py --updates 12",
             resume: dict | None = None, **program) -> Path:
    """A copy of examples/own-loop with ``patches`` (old text -> new text) planted in train.py; its spec (the resume
    gate at a save after update 2 that pilotrun asks for, unless ``resume`` says otherwise)."""
    folder = planted_example("own-loop", tmp_path / "prog", patches)
    return write_spec(folder / "pilot.yaml", {"name": "prog", "program": {"command": command, "timeout": 120,
                                                                          **program},
                                              "pilot": {"resume": {"before": 2} if resume is None else resume}})


def _pilot(spec_path: Path, tmp_path: Path, gates=("resume",)):
    spec = load_spec(spec_path, allow_program=True)
    return run_pilot(spec, PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "l.sqlite",
                                        gates=list(gates), container_digest=TEST_DIGEST))


# -- the spec --------------------------------------------------------------------------------------------------
def test_program_spec_needs_no_model_and_hashes_the_script(tmp_path):
    spec = load_spec(_program(tmp_path), allow_program=True)
    assert isinstance(spec, ProgramOnlySpec) and spec.model is None and spec.program is not None
    assert spec.program.words == ["python", "train.py", "--updates", "12"]
    assert "program" in spec.canonical() and "model" not in spec.canonical()
    with pytest.raises(ProgramSpecRefused, match="pilotrun run"):  # estimate/select/plan need a model
        load_spec(_program(tmp_path / "b"))
    # a spec without program: keeps the canonical form (and so the config hash) it had before the key existed
    assert "program" not in load_spec(copy_fixture("toy", tmp_path / "c")).canonical()


def test_a_module_run_with_dash_m_is_the_file_the_lock_hashes(tmp_path):
    # Found piloting `command: [python, -m, mlp_train, ...]`: the lock passed with "0 file(s) hashed", so an edited
    # training script would not show as drift.
    from pilotrun.config.program import program_files

    for i, command in enumerate((["python", "-m", "train", "--updates", "4"],
                                 "torchrun --standalone --nproc_per_node=2 -m train")):
        spec = load_spec(_program(tmp_path / str(i), command=command), allow_program=True)
        files, why = program_files(spec.program, spec.folder)
        assert [f.name for f in files] == ["train.py"] and "(train.py)" in why, (command, why)
    spec_path = _program(tmp_path / "pkg", command="python -m trainer")
    (spec_path.parent / "trainer").mkdir()
    (spec_path.parent / "trainer" / "__main__.py").write_text("print('hi')\n")
    spec = load_spec(spec_path, allow_program=True)
    assert [f.relative_to(spec.folder).as_posix() for f in program_files(spec.program, spec.folder)[0]] == [
        "trainer/__main__.py"]


def test_the_headline_of_a_program_pilot_shows_no_time_per_update_it_did_not_measure():
    from pilotrun.ui.console import headline

    rows = [GateRow.now("steady_step", "pass", "", details={"stages": 8}), GateRow.now("resume", "pass", "")]
    assert "/update" not in headline(rows, "pass").plain
    rows[0].details["seconds_per_update"] = 0.25
    assert "250 ms/update" in headline(rows, "pass").plain


@pytest.mark.parametrize("program, field, words", [
    ({"command": "python missing.py"}, "program.command", "missing.py not found"),
    ({"command": ""}, "program.command", "give the program's command line"),
    ({"command": "python 'unclosed"}, "program.command", "close the quote"),
    ({"command": "python train.py", "files": ["*.nothing"]}, "program.files[0]", "matches no file"),
    ({"command": "python train.py", "timeout": 0}, "program.timeout", "must be positive"),
    # found piloting independent programs: these two reached Popen and ended as an internal error (exit 3)
    ({"command": "trainme-nowhere --fast"}, "program.command", "nor a command on PATH"),
    ({"command": "./train.py --x 1"}, "program.command", "not an executable file"),  # exists, not executable
    ({"command": "torchrun --nproc-per-node 2 gone.py"}, "program.command", "gone.py not found"),
])
def test_bad_program_specs_name_the_field(tmp_path, program, field, words):
    path = _program(tmp_path)
    write_spec(path, {"name": "prog", "program": program})
    with pytest.raises(SpecError) as err:
        load_spec(path, allow_program=True)
    assert any(f == field and words in m for f, m in err.value.problems), err.value.problems


def test_run_help_shows_a_program_example(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "program:" in out and "pilotrun.program()" in out and "torchrun" in out


def test_program_with_part_of_model_data_train_names_the_fix(tmp_path, capsys):
    path = _program(tmp_path)
    write_spec(path, {"name": "prog", "program": {"command": "python train.py"}, "model": {"factory": "a:b"}})
    assert main(["run", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "give all of model, data and train" in capsys.readouterr().err


# -- the example, standalone and piloted ----------------------------------------------------------------------
@pytest.mark.process
def test_the_example_trains_alone_without_pilotrun(tmp_path):
    folder = tmp_path / "alone"
    shutil.copytree(EXAMPLES / "own-loop", folder, ignore=shutil.ignore_patterns("__pycache__", "checkpoints"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PILOTRUN_") or k == "PILOTRUN_TEST_SESSION"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "train.py", "--updates", "4", "--save-every", "2"], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "updates 1..4" in out.stdout
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["update-2.pt", "update-4.pt"]


# Each planted defect, the field the resume gate must name and the cause it must give.
DEFECTS = {
    "scheduler-not-restored": ({'    sched.load_state_dict(state["scheduler"])\n': "",
                                # and a row an integration would record from inside the program
                                "job = pilotrun.program()  # pilotrun: inert when run without pilotrun\n":
                                    "job = pilotrun.program()\njob.record_gate('inspect', 'warn', 'planted', n=2)\n"},
                               "lr", Cause.SCHEDULER_NOT_RESTORED),
    "unseeded-shuffle": ({"random.Random(1000 + epoch).shuffle(order)": "random.shuffle(order)"}, "ids",
                         Cause.NOT_REPRODUCIBLE),
    "saved-before-step": ({"        opt.step()\n": "        if update % args.save_every == 0 or job.should_save(update):"
                                                   "\n            path = save(update)\n        opt.step()\n",
                           "            path = save(update)\n            if distributed:":
                               "            if distributed:"}, "loss", Cause.STATE_SAVED_AT_WRONG_POINT),
}


@pytest.mark.process
@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_planted_resume_defects_are_caught_by_the_resume_gate(tmp_path, defect):
    patches, field, cause = DEFECTS[defect]
    result = _pilot(_program(tmp_path, patches), tmp_path, gates=("inspect", "resume"))
    (row,) = [r for r in result.rows if r["gate"] == "resume"]
    (inspect,) = [r for r in result.rows if r["gate"] == "inspect"]
    if defect == "scheduler-not-restored":  # recorded with job.record_gate: taken from the control run only
        assert (inspect["verdict"], inspect["reason"], inspect["details"]["n"]) == ("warn", "planted", 2)
    else:
        assert inspect["verdict"] == "skip" and "integration" in inspect["reason"]
    assert row["verdict"] == Verdict.FAIL, row["reason"]
    diff = row["details"]["difference"]
    assert (diff["field"], diff["cause"]) == (field, str(cause)), row["reason"]
    assert diff["update"] == (1 if cause == Cause.NOT_REPRODUCIBLE else 3)  # N=2: the first resumed update is 3
    # fresh runs that already differ make a resume meaningless: the resumed run is then not started
    assert (tmp_path / "out" / "program" / "resumed.log").exists() == (cause != Cause.NOT_REPRODUCIBLE)
    assert row["details"]["failure"] == Failure.CHECK and result.exit_code == 1


def _outcome(role, updates=(), problems=(), returncode=0, killed=False, saved=None, tmp=Path("/nonexistent")):
    events = [{"kind": "update", "update": u, "loss": 1.0 / u, "lr": 0.1, "grad_norm": 1.0, "ids": [u], "extra": {}}
              for u in updates]
    events += [{"kind": "problem", "rank": 0, **p} for p in problems]
    if saved:
        events.append({"kind": "saved", "update": saved, "path": str(tmp / "ck.pt")})
    return RunOutcome(role, returncode, 0.1, tmp / f"{role}.log", events={0: events}, killed=killed, killed_pids=[1])


def test_resume_rows_before_comparing_invalid_values_crashes_and_missing_updates(tmp_path):
    control = _outcome(Role.CONTROL, [1, 2, 3, 4])
    interrupted = _outcome(Role.INTERRUPTED, [1, 2], killed=True, saved=2, returncode=-9)
    nan = {"update": 3, "field": "loss", "problem": "loss is nan (non-finite)", "non_finite": True}
    runs = {Role.CONTROL: _outcome(Role.CONTROL, [1, 2, 4], problems=[nan]), Role.INTERRUPTED: interrupted}
    (row,) = resume_rows(runs, 2, 2, EXACT)
    assert row.failure == Failure.NON_FINITE and "update 3" in row.reason and "loss is nan" in row.reason
    crashed = _outcome(Role.RESUMED, [3], returncode=1, tmp=tmp_path)
    (tmp_path / "resumed.log").write_text("Traceback ...\nKeyError: 'scheduler'\n")
    (row,) = resume_rows({Role.CONTROL: control, Role.INTERRUPTED: interrupted, Role.RESUMED: crashed}, 2, 2, EXACT)
    assert row.failure == Failure.ERROR and "exited with 1" in row.reason and "KeyError" in row.reason
    assert "job.saved only once the write is complete" not in row.reason  # it got past the load: update 3
    # Before its first update, on a checkpoint that is not there: the advice about job.saved's timing applies ...
    never = _outcome(Role.RESUMED, [], returncode=1, tmp=tmp_path)
    (tmp_path / "resumed.log").write_text(
        "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n    torch.load(path)\n"
        "FileNotFoundError: [Errno 2] No such file or directory: 'ck/state.pt'\n")
    (row,) = resume_rows({Role.CONTROL: control, Role.INTERRUPTED: interrupted, Role.RESUMED: never}, 2, 2, EXACT)
    assert "before its first update" in row.reason and "job.saved only once the write is complete" in row.reason
    assert "FileNotFoundError: [Errno 2] No such file or directory: 'ck/state.pt'" in row.reason
    # ... on one it cannot unpickle, it does not (issue 44: a ReduceLROnPlateau refused by weights_only), and the
    # exception is quoted whole, from its type, not from mid-word.
    (tmp_path / "resumed.log").write_text(
        "step 2 saved\nTraceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
        "    torch.load(path)\n_pickle.UnpicklingError: Weights only load failed. This file can still be loaded, to "
        "do so you have two options.\n\n(1) In PyTorch 2.6, we changed the default value of the `weights_only`"
        " argument.\n(2) Alternatively, to load with `weights_only=True` please check the recommended steps in the "
        "following error message.\nWeightsUnpickler error: Unsupported global: GLOBAL torch.optim.lr_scheduler."
        "ReduceLROnPlateau was not an allowed global by default. Please use `torch.serialization.add_safe_globals("
        "[torch.optim.lr_scheduler.ReduceLROnPlateau])` to allowlist this global.\n")
    (row,) = resume_rows({Role.CONTROL: control, Role.INTERRUPTED: interrupted, Role.RESUMED: never}, 2, 2, EXACT)
    assert "exited with 1: _pickle.UnpicklingError: Weights only load failed." in row.reason, row.reason
    assert "job.saved only once the write is complete" not in row.reason and "ReduceLROnPlateau" in row.reason
    short = _outcome(Role.RESUMED, [3])
    (row,) = resume_rows({Role.CONTROL: control, Role.INTERRUPTED: interrupted, Role.RESUMED: short}, 2, 2, EXACT)
    assert row.details["difference"]["cause"] == Cause.MISSING_UPDATES and row.details["difference"]["update"] == 4
    never_saved = _outcome(Role.INTERRUPTED, [1, 2, 3, 4])  # ran to its end: no job.saved(), so no kill
    (row,) = resume_rows({Role.CONTROL: control, Role.INTERRUPTED: never_saved}, 2, 2, EXACT)
    assert "never called job.saved" in row.reason and "job.saved(2, path)" in row.reason


def _two_ranks(role, updates, differ=None, killed=False, saved=None, tmp=Path("/nonexistent")):
    """A 2-rank run; ``differ``: {rank: (update, field)} whose value moves from that update on."""
    events = {}
    for rank in (0, 1):
        moved = (differ or {}).get(rank)
        events[rank] = [{"kind": "update", "rank": rank, "update": u, "ids": [2 * u + rank], "lr": 0.1, "extra": {},
                         "loss": 1.0 / u + (1e-3 if moved and moved[1] == "loss" and u >= moved[0] else 0.0),
                         "grad_norm": 1.0 + (1e-3 if moved and moved[1] == "grad_norm" and u >= moved[0] else 0.0)}
                        for u in updates]
    if saved:
        events[0].append({"kind": "saved", "update": saved, "path": str(tmp / "ck.pt")})
    return RunOutcome(role, -9 if killed else 0, 0.1, tmp / f"{role}.log", events=events, killed=killed,
                      killed_pids=[1] if killed else [])


def test_a_rank_whose_grad_norm_follows_another_ranks_loss_is_pointed_at_that_rank(tmp_path):
    # Found piloting a DDP loop that restored rank 0's RNG on both ranks: rank 1's dropout, so its loss, differed at
    # the first resumed update; rank 0's loss matched but its grad_norm (all-reduced gradients) moved, and its row
    # blamed rank 0's own gradients ("not zeroed, or a grad scaler's state"), sending the fix to the wrong rank.
    control = _two_ranks(Role.CONTROL, [1, 2, 3, 4])
    interrupted = _two_ranks(Role.INTERRUPTED, [1, 2], killed=True, saved=2, tmp=tmp_path)
    resumed = _two_ranks(Role.RESUMED, [3, 4], differ={0: (3, "grad_norm"), 1: (3, "loss")})
    rows = {r.rank: r for r in resume_rows({Role.CONTROL: control, Role.INTERRUPTED: interrupted,
                                            Role.RESUMED: resumed}, 2, 2, EXACT)}
    assert rows[1].details["difference"]["cause"] == Cause.STATE_SAVED_AT_WRONG_POINT
    diff = rows[0].details["difference"]
    assert (diff["field"], diff["cause"]) == ("grad_norm", Cause.OTHER_RANK), rows[0].reason
    assert "rank 1 differs first: loss at update 3" in rows[0].reason and "scaler" not in rows[0].reason
    # the same in two fresh runs (rank 1 seeded from its pid): rank 0's row stays "not reproducible" but names rank 1
    unseeded = _two_ranks(Role.INTERRUPTED, [1, 2], differ={0: (1, "grad_norm"), 1: (1, "loss")}, killed=True,
                          saved=2, tmp=tmp_path)
    rows = {r.rank: r for r in resume_rows({Role.CONTROL: control, Role.INTERRUPTED: unseeded}, 2, 2, EXACT)}
    assert rows[0].details["difference"]["cause"] == Cause.NOT_REPRODUCIBLE
    assert "rank 1 differs first: loss at update 1" in rows[0].reason
    # a grad_norm difference with no other rank behind it keeps its own cause
    alone = _two_ranks(Role.RESUMED, [3, 4], differ={0: (3, "grad_norm")})
    rows = {r.rank: r for r in resume_rows({Role.CONTROL: control, Role.INTERRUPTED: interrupted,
                                            Role.RESUMED: alone}, 2, 2, EXACT)}
    assert rows[0].details["difference"]["cause"] == Cause.GRADIENT_STATE and rows[1].verdict == Verdict.PASS


def test_a_rank_reporting_no_updates_is_named_not_passed_over(tmp_path):
    # Found piloting a DDP loop calling job.update on rank 0 only, whose rank 1 resumed with rank 0's RNG: the one
    # row (rank 0's grad_norm) blamed rank 0's own gradients, and a clean run of that loop passed for "all" ranks.
    def rank0_only(role, updates, **kw):
        run = _two_ranks(role, updates, **kw)
        run.events[1] = [{"kind": "start", "rank": 1, "world_size": 2}]
        return run
    control = rank0_only(Role.CONTROL, [1, 2, 3, 4])
    interrupted = rank0_only(Role.INTERRUPTED, [1, 2], killed=True, saved=2, tmp=tmp_path)
    (row,) = resume_rows({Role.CONTROL: control, Role.INTERRUPTED: interrupted,
                          Role.RESUMED: rank0_only(Role.RESUMED, [3, 4])}, 2, 2, EXACT)
    assert row.verdict == Verdict.WARN and "rank(s) 1 reported no updates" in row.reason
    assert row.details["ranks_without_updates"] == [1]
    (row,) = resume_rows({Role.CONTROL: control, Role.INTERRUPTED: interrupted,
                          Role.RESUMED: rank0_only(Role.RESUMED, [3, 4], differ={0: (3, "grad_norm")})}, 2, 2, EXACT)
    assert row.verdict == Verdict.FAIL and "a difference on rank(s) 1" in row.reason and "every rank" in row.reason


def test_two_ranks_rows_say_their_rank_and_world_size_in_the_table(tmp_path):
    # Found piloting a 2-rank DDP loop: the resume rows said "rank 1 of world size 1" and the table showed two
    # identical "resume pass" lines.
    from rich.console import Console

    from pilotrun.ui.console import gate_table

    runs = {Role.CONTROL: _two_ranks(Role.CONTROL, [1, 2, 3, 4]), Role.RESUMED: _two_ranks(Role.RESUMED, [3, 4]),
            Role.INTERRUPTED: _two_ranks(Role.INTERRUPTED, [1, 2], killed=True, saved=2, tmp=tmp_path)}
    rows = resume_rows(runs, 2, 2, EXACT)
    assert [(r.rank, r.world_size, r.verdict) for r in rows] == [(0, 2, "pass"), (1, 2, "pass")]
    lock = GateRow.now("lock", "pass", "ok")
    console = Console(width=200, record=True)
    console.print(gate_table([lock, *rows]))
    text = console.export_text()
    assert "resume [rank 0]" in text and "resume [rank 1]" in text and "lock [rank" not in text


@pytest.mark.process
def test_the_example_under_torchrun_two_gloo_processes_passes_every_gate_it_can_run(tmp_path):
    folder = tmp_path / "own-loop"
    shutil.copytree(EXAMPLES / "own-loop", folder, ignore=shutil.ignore_patterns("__pycache__", "checkpoints"))
    out = subprocess.run([sys.executable, "-m", "pilotrun", "run", str(folder / "pilot.yaml"), "--json",
                          "--out", str(tmp_path / "out"), "--ledger", str(tmp_path / "l.sqlite"),
                          "--container-digest", TEST_DIGEST], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    # The program's own torchrun keeps its folders in the run's, not in one /tmp/torchelastic_* per run.
    assert not list(Path(os.environ["TMPDIR"]).glob("torchelastic_*"))  # this test's own (tests/conftest.py)
    assert len(list((tmp_path / "out" / "program" / "torchrun").iterdir())) >= 3  # control, interrupted, resumed
    rows = json.loads(out.stdout)["gates"]
    resume = [r for r in rows if r["gate"] == "resume"]
    assert sorted(r["rank"] for r in resume) == [0, 1] and {r["verdict"] for r in resume} == {"pass"}
    # torchrun, its two ranks (each in its own session) and their groups: all SIGKILLed, none left
    assert len(resume[0]["details"]["killed_pids"]) >= 3
    assert sorted(r["rank"] for r in rows if r["gate"] == "steady_step") == [0, 1]
    skipped = [r for r in rows if r["verdict"] == "skip"]
    assert skipped and all(r["reason"].startswith("not measured") for r in skipped)
    assert {r["gate"] for r in skipped} >= {"inspect", "accum_equivalence", "restore", "reload_eval"}
    assert not [r for r in rows if r["verdict"] == "fail"]
    (lock,) = [r for r in rows if r["gate"] == "lock"]
    program = lock["details"]["program"]
    assert program["command"][:2] == ["torchrun", "--standalone"] and list(program["files"]) == ["train.py"]
    assert program["files"]["train.py"] == __import__("hashlib").sha256((folder / "train.py").read_bytes()).hexdigest()
    details = resume[0]["details"]
    assert details["compared_updates"] == [3, 4] and details["largest_relative_difference"] == 0.0
    assert details["killed_after_update"] == 2
    assert not [p for p in details["killed_pids"] if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    program = tmp_path / "out" / "program"
    assert "final train loss" not in (program / "interrupted.log").read_text()  # killed before it could finish
    for rank in (0, 1):
        events = [json.loads(e) for e in (program / "events" / f"resumed-rank{rank}.jsonl").read_text().splitlines()]
        assert [e["update"] for e in events if e["kind"] == Event.UPDATE] == [3, 4]
    # the stage gates come from the control run's stages, one row per rank; a gate the program cannot run says why
    by_gate = {(r["gate"], r["rank"]): r for r in rows}
    assert by_gate[("first_step", 1)]["verdict"] == by_gate[("save", 0)]["verdict"] == "pass"
    assert by_gate[("load", 0)]["verdict"] == "skip" and 'job.stage("load")' in by_gate[("load", 0)]["reason"]
    with Ledger(tmp_path / "l.sqlite") as led:
        run_id = json.loads(out.stdout)["run_id"]
        assert len(led.gate_rows(run_id)) == len(rows) and led.run(run_id)["status"] == "pass"


@pytest.mark.process
def test_without_the_resume_gate_one_stages_run_and_a_nan_loss_fails_steady_step(tmp_path):
    patch = {"job.update(update, loss=loss,": "job.update(update, loss=float('nan') if update == 3 else loss,"}
    result = _pilot(_program(tmp_path, patch), tmp_path, gates=("steady_step",))
    rows = {r["gate"]: r for r in result.rows}
    assert "resume" not in rows and sorted(p.name for p in (tmp_path / "out" / "program").glob("*.log")) == [
        "stages.log"]
    assert rows["steady_step"]["verdict"] == Verdict.FAIL and "update 3: loss is nan" in rows["steady_step"]["reason"]
    assert rows["steady_step"]["details"]["failure"] == Failure.NON_FINITE
    assert rows["first_step"]["verdict"] == Verdict.PASS


@pytest.mark.process
def test_a_program_past_its_timeout_is_killed_with_its_whole_tree(tmp_path):
    """A child in its own session (as torchrun starts each rank) dies with the program: no orphan survives."""
    from pilotrun.config.program import ProgramSpec
    from pilotrun.program.runner import RunPlan, run_program

    script = tmp_path / "hang.py"
    script.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
                      "start_new_session=True)\n"
                      "open('child.pid', 'w').write(str(child.pid))\n"
                      "time.sleep(120)\n")
    program = ProgramSpec(command=["python", "hang.py"], timeout=4.0)
    outcome = run_program(program, tmp_path, RunPlan(Role.CONTROL, stop_at=4), tmp_path / "out", "r1",
                          tmp_path / "l.sqlite")
    child = int((tmp_path / "child.pid").read_text())
    assert outcome.timed_out and not outcome.ended_cleanly and child in outcome.killed_pids
    assert "program.timeout" in outcome.how_it_ended()
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_passing_resume_row_names_only_the_fields_the_program_reported(tmp_path):
    # Found piloting a loop that reports no ids and no grad_norm: the warn row said "equal ... (ids, loss, lr,
    # grad_norm, extra)" and then "the data order was not compared".
    def bare(role, updates, **kw):
        out = _outcome(role, updates, **kw)
        for e in out.events[0]:
            e.update(ids=None, grad_norm=None, extra={"micro_batches": 1.0} if e["kind"] == "update" else None)
        return out
    runs = {Role.CONTROL: bare(Role.CONTROL, [1, 2, 3, 4]), Role.RESUMED: bare(Role.RESUMED, [3, 4]),
            Role.INTERRUPTED: bare(Role.INTERRUPTED, [1, 2], killed=True, saved=2, returncode=-9, tmp=tmp_path)}
    (row,) = resume_rows(runs, 2, 2, EXACT)
    assert row.verdict == Verdict.WARN and row.details["compared_fields"] == ["loss", "lr", "extra.micro_batches"]
    assert "(loss, lr, extra.micro_batches)" in row.reason and "grad_norm" not in row.reason.split(";")[0]
    assert "reports no ids" in row.reason
    full = {role: _outcome(role, run_updates, killed=role == Role.INTERRUPTED, saved=2 if role == Role.INTERRUPTED
                           else None, tmp=tmp_path) for role, run_updates in
            ((Role.CONTROL, [1, 2, 3, 4]), (Role.INTERRUPTED, [1, 2]), (Role.RESUMED, [3, 4]))}
    (row,) = resume_rows(full, 2, 2, EXACT)
    assert row.verdict == Verdict.PASS and "(ids, loss, lr, grad_norm)" in row.reason
    # An integration's ids for items without one are their dataset positions: the row says what it compared.
    for run in full.values():
        for e in run.events[0]:
            e["extra"] = {"ids_are": "dataset-position"}
    (row,) = resume_rows(full, 2, 2, EXACT)
    assert row.verdict == Verdict.PASS and "(dataset positions, loss, lr, grad_norm)" in row.reason, row.reason
    assert row.details["ids_are"] == "dataset-position" and "extra.ids_are" not in row.details["compared_fields"]


def test_one_resumed_update_compared_warns_that_the_optimizer_state_was_not_checked(tmp_path):
    # Found piloting a loop that saved no AdamW state: with pilot.resume.after: 1 only the first resumed update was
    # compared, whose loss and grad_norm precede any optimizer.step(), and the row passed.
    def runs(after):
        return {Role.CONTROL: _outcome(Role.CONTROL, range(1, 3 + after)), Role.RESUMED: _outcome(Role.RESUMED,
                range(3, 3 + after)), Role.INTERRUPTED: _outcome(Role.INTERRUPTED, [1, 2], killed=True, saved=2,
                                                                 returncode=-9, tmp=tmp_path)}
    (row,) = resume_rows(runs(1), 2, 1, EXACT)
    assert row.verdict == Verdict.WARN and "optimizer state was not checked" in row.reason
    assert "pilot.resume.after: 2" in row.reason
    (row,) = resume_rows(runs(2), 2, 2, EXACT)
    assert row.verdict == Verdict.PASS and "optimizer" not in row.reason


def _resume_of(tmp_path: Path, source: str, spec: dict):
    """The resume gate alone on a one-file program ``train.py`` (``spec`` without its program section)."""
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "train.py").write_text(source)
    loaded = load_spec(write_spec(folder / "pilot.yaml", {**spec, "program": {"command": "python train.py"}}),
                       allow_program=True)
    result = run_pilot(loaded, PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "l.sqlite",
                                            gates=["resume"], container_digest=TEST_DIGEST))
    return result, next(r for r in result.rows if r["gate"] == "resume")

@pytest.mark.process
def test_a_control_run_that_fails_starts_no_interrupted_or_resumed_run(tmp_path):
    # Found piloting a program that ignores should_stop: the control run timed out, then the interrupted and the
    # resumed runs were started anyway and the resumed one timed out too (3 x program.timeout for one known failure).
    result, row = _resume_of(tmp_path, "import sys, pilotrun\njob = pilotrun.program()\n"
                                       "print('no config given', file=sys.stderr)\nsys.exit(1)\n", {"name": "crash"})
    assert row["verdict"] == Verdict.FAIL and "exited with 1" in row["reason"] and "no config given" in row["reason"]
    assert "were not started" in row["reason"] and result.exit_code == 1
    assert sorted(p.name for p in (tmp_path / "out" / "program").glob("*.log")) == ["control.log"]


@pytest.mark.process
def test_a_control_run_that_stops_before_resume_before_plus_after_says_so_and_starts_no_other_run(tmp_path):
    # Found piloting a Lightning script with max_steps 8 and pilot.resume {before: 8, after: 2}: the row said
    # "update 9: update (missing in control) 'missing' (control) vs 'missing' (resumed)".
    _, row = _resume_of(tmp_path, "import pilotrun\njob = pilotrun.program()\n"
                                  "for u in range(1, 4):\n    job.update(u, loss=1.0 / u, lr=0.1, ids=[u])\n",
                        {"name": "short", "pilot": {"resume": {"before": 2, "after": 2}}})
    assert row["verdict"] == Verdict.FAIL and "exited with 0 after update 3" in row["reason"], row["reason"]
    assert "updates up to 4" in row["reason"] and "pilot.resume.before/after" in row["reason"]
    assert sorted(p.name for p in (tmp_path / "out" / "program").glob("*.log")) == ["control.log"]


def test_an_interrupted_run_whose_processes_outlive_sigkill_fails_resume_without_a_resumed_run(tmp_path):
    # kill_tree now waits for the killed descendants (SIGKILL lands asynchronously; the timeout test saw the child
    # still 'running' right after the kill); any still alive then are named and nothing is started beside them.
    interrupted = _outcome(Role.INTERRUPTED, [1, 2], killed=True, saved=2, returncode=-9, tmp=tmp_path)
    interrupted.survivors = [4242]
    (row,) = resume_rows({Role.CONTROL: _outcome(Role.CONTROL, [1, 2, 3, 4]), Role.INTERRUPTED: interrupted}, 2, 2,
                         EXACT)
    assert row.verdict == Verdict.FAIL and row.failure == Failure.ERROR
    assert "[4242] were still alive" in row.reason and "resumed run was not started" in row.reason


def test_a_failed_torchrun_rank_is_quoted_from_what_the_rank_printed_not_torchruns_summary():
    from pilotrun.program.runner import failure_lines

    # shortened from a real 2-rank gloo run whose rank 1 aborted at exit
    log = ("*****************************************\nSetting OMP_NUM_THREADS environment variable for each process"
           "\n*****************************************\nterminate called without an active exception\n"
           "W1201 07:24:31.204000 22742 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 22747 "
           "closing signal SIGTERM\nE1201 07:24:31.240000 22742 torch/distributed/elastic/multiprocessing/api.py:1002]"
           " failed (exitcode: -6) local_rank: 1 (pid: 22748) of binary: /usr/bin/python\nTraceback (most recent "
           "call last):\n  File \"run.py\", line 1032\ntorch.distributed.elastic.multiprocessing.errors."
           "ChildFailedError: \n=====\n  traceback : Signal 6 (SIGABRT) received by PID 22748\n=====\n")
    said = failure_lines(log)
    assert "terminate called without an active exception" in said and "failed (exitcode: -6) local_rank: 1" in said
    assert "*****" not in said and "SIGTERM" not in said
    assert failure_lines("step 1\nTraceback:\nKeyError: 'scheduler'\n") == "step 1 | Traceback: | KeyError: 'scheduler'"
    # A rank's Python exception before torchrun's report is quoted whole, its rank prefix dropped.
    raised = log.replace("terminate called without an active exception\n",
                         "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"t.py\", line 3\n"
                         "[rank1]: ValueError: the batch is empty\n")
    said = failure_lines(raised)
    assert said.startswith("ValueError: the batch is empty | ") and "failed (exitcode: -6) local_rank: 1" in said


@pytest.mark.process
def test_a_program_that_leaves_a_child_and_a_daemon_warns_naming_them_and_leaves_nothing_running(tmp_path):
    # Found trying the landed code as an attacker: a Popen'd child and a double-forked setsid daemon outlived a
    # passing program pilot, one of each per run.
    from tests.test_procs import LEAVES_TWO, _gone, _kill, _pids

    pids = tmp_path / "pids"
    folder = tmp_path / "p"
    folder.mkdir()
    # And event files a hand could have written: a file of no rank, lines that are not events (exit 3 before).
    bad_events = ("events = os.environ['PILOTRUN_EVENTS']\n"
                  "open(os.path.join(events, 'stages-rankfoo.jsonl'), 'w').write('{}\\n')\n"
                  "open(job.events_path, 'a').write('[1]\\n{\"kind\": \"update\", \"update\": \"x\"}\\n')\n")
    (folder / "train.py").write_text(f"PIDS = {str(pids)!r}\nimport pilotrun\njob = pilotrun.program()\n" + LEAVES_TWO
                                     + "with job.stage('first_step'):\n    job.update(1, loss=1.0, lr=0.1, ids=[1])\n"
                                     + bad_events)
    spec = load_spec(write_spec(folder / "pilot.yaml", {"name": "leaves", "program": {"command": "python train.py"}}),
                     allow_program=True)
    result = run_pilot(spec, PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "l.sqlite",
                                          gates=["first_step"], container_digest=TEST_DIGEST))
    left = _pids(pids, 1)
    try:
        assert _gone(left, 5) == [], "a process the program started outlived its run"
        row = next(r for r in result.rows if r["gate"] == "first_step")
        assert row["verdict"] == Verdict.WARN and result.exit_code == 0
        assert all(f"pid {pid} (" in row["reason"] for pid in left), row["reason"]
        assert "time.sleep(301)" in row["reason"] and "the stages run left" in row["reason"]
        assert sorted(p["pid"] for p in row["details"]["leftovers"]["stages"]) == sorted(left)
        said = row["details"]["event_problems"]["stages"]
        assert any("stages-rankfoo.jsonl is not named <role>-rank<N>.jsonl" in p for p in said), said
        assert any("is not an event (a JSON object" in p for p in said) and any("'update' is not int" in p for p in said)
    finally:
        _kill(left)


# -- pilot.resume.before: auto, the program's own checkpoint --------------------------------------------------------

# nanoGPT's evaluation runs at the top of the step it resumes from as well: at its own checkpoints, a resume repeats
# an RNG-drawing evaluation. A save pilotrun forces between two of them never shows it.
EVAL_AGAIN_ON_RESUME = {'    start = state["update"]\n': '    start = state["update"]\n'
                        '    if start % args.save_every == 0:  # its evaluation at the checkpoint step, again\n'
                        '        torch.rand(1)\n'}


@pytest.mark.process
def test_auto_proves_the_resume_at_the_programs_own_checkpoint_where_a_defect_a_forced_save_misses_shows(tmp_path):
    command = "python train.py --updates 12 --save-every 3"
    row = _resume_row(_pilot(_program(tmp_path / "clean", command=command, resume={}), tmp_path / "clean"))
    assert row["verdict"] == Verdict.PASS, row["reason"]
    assert "proven at the program's own checkpoint after update 3 (pilot.resume.before: auto)" in row["reason"]
    assert row["details"]["save_point"] == {"update": 3, "kind": "own", "own_saves": [3], "auto": True}
    assert row["details"]["before"] == 3 and row["details"]["compared_updates"] == [4, 5]

    planted = _program(tmp_path / "planted", EVAL_AGAIN_ON_RESUME, command=command, resume={})
    row = _resume_row(_pilot(planted, tmp_path / "planted"))
    assert row["verdict"] == Verdict.FAIL and "after the resume" in row["reason"], row["reason"]
    # The same defect at a save pilotrun asks for (update 2): passes, and the row says the long run resumes elsewhere.
    forced = _program(tmp_path / "forced", EVAL_AGAIN_ON_RESUME, command=command, resume={"before": 2})
    row = _resume_row(_pilot(forced, tmp_path / "forced"))
    assert row["verdict"] == Verdict.WARN, row["reason"]
    assert "one pilotrun asked for (pilot.resume.before 2)" in row["reason"]
    assert "saves on its own after update(s) 3" in row["reason"] and "pilot.resume.before: auto" in row["reason"]


def _resume_row(result) -> dict:
    return next(r for r in result.rows if r["gate"] == "resume")


@pytest.mark.process
def test_auto_on_a_program_that_never_saves_fails_naming_the_fix_and_runs_it_once(tmp_path):
    spec = _program(tmp_path, command="python train.py --updates 4", resume={})  # saves every 20, on its own
    row = _resume_row(_pilot(spec, tmp_path))
    assert row["verdict"] == Verdict.FAIL, row["reason"]
    assert "after update 4 without a checkpoint of its own, before update 50 (pilot.resume.auto_within)" in row[
        "reason"] and "pilot.resume.before: N" in row["reason"]
    assert sorted(p.name for p in (tmp_path / "out" / "program").glob("*.log")) == ["control.log"]


def test_the_save_point_says_whose_checkpoint_the_proof_ran_at():
    from pilotrun.program.resume import SaveKind, save_point

    def control(*saves):
        out = _outcome(Role.CONTROL, range(1, 9))
        out.events[0] += [{"kind": "saved", "update": u, "path": "/x", "asked": asked} for u, asked in saves]
        return out

    assert save_point(control(), "auto", 50) is None
    limit = save_point(control((50, True)), "auto", 50)
    assert limit.kind == SaveKind.ASKED_AT_LIMIT and limit.said(8)[1] is True
    assert "no checkpoint of its own by update 50" in limit.said(8)[0]
    # `update % every == 0 or job.should_save(update)` never asks at its own points: that save is its own.
    assert save_point(control((4, False)), 4, 50).kind == SaveKind.OWN
    asked = save_point(control((2, True)), 2, 50)
    assert asked.kind == SaveKind.ASKED and asked.said(4) == (
        "the save after update 2 was one pilotrun asked for (pilot.resume.before 2); the program made no checkpoint "
        "of its own in the control's 4 updates to prove instead (pilot.resume.before: auto proves its first)", False)


def test_under_auto_every_rank_stops_after_the_first_save_whichever_rank_reported_it(tmp_path):
    # Most programs (and both integrations) call job.saved on rank 0 only: rank 1 must still stop with rank 0, or it
    # trains on alone into a collective nobody joins.
    from pilotrun.program import env as E
    from pilotrun.program.handle import ProgramHandle

    def rank(r: int) -> ProgramHandle:
        return ProgramHandle(environ={E.PROGRAM: "1", E.ROLE: "control", E.RUN_ID: "t", E.EVENTS: str(tmp_path / "ev"),
                                      E.CHECKPOINT_DIR: str(tmp_path / "ck"), E.SAVE_AUTO: "50,2", "RANK": str(r),
                                      "WORLD_SIZE": "2"})

    zero, one = rank(0), rank(1)
    (tmp_path / "ck").mkdir()
    assert not one.should_save(3) and not one.should_stop(4)
    zero.saved(3, tmp_path / "ck")  # the program's own save, reported on rank 0 only
    assert [zero.should_stop(u) for u in (4, 5)] == [one.should_stop(u) for u in (4, 5)] == [False, True]
    assert not one.should_save(50)  # nor does rank 1 alone ask for a save at the limit
    # A program that saved nothing, not even where pilotrun asked, stops `after` updates past the limit anyway.
    other = ProgramHandle(environ={E.PROGRAM: "1", E.ROLE: "stages", E.RUN_ID: "t", E.EVENTS: str(tmp_path / "ev2"),
                                   E.SAVE_AUTO: "5,2"})
    assert other.should_save(5) and not other.should_stop(6) and other.should_stop(7)


def test_auto_whose_first_checkpoint_leaves_nothing_to_compare_says_so():
    from pilotrun.program.resume import SaveKind, SavePoint, no_room_row

    control = _outcome(Role.CONTROL, range(1, 13))
    row = no_room_row(control, SavePoint(12, SaveKind.OWN, (12,), True, 50), 2)
    assert row.verdict == Verdict.FAIL and "first checkpoint of its own is after update 12" in row.reason
    assert "A checkpoint at the end of training is not one a long run resumes from" in row.reason
    assert "lower pilot.resume.before" not in row.reason
