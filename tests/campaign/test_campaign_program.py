"""Campaigns of the user's program (issue 20, 2): the varied value and the seed reach the program through a template,
every update and validation comes back through the handle into the run's series, pilotrun's stop rules stop a run
through ``should_stop`` at the update that broke one, and every run keeps its row.

Pure tests build the runs' specs and drive a handle in this process; the process test runs the hf-trainer example's
own train.py (a transformers Trainer) as a 3-lr x 2-seed campaign where one lr diverges."""
from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys

import pytest
import yaml

from pilotrun.campaign.spec import ProgramTemplate, load_campaign, run_spec
from pilotrun.config.schema import SpecError
from pilotrun.workers.common import write_spec_file
from tests.conftest import EXAMPLES, pilotrun_cli, polled_rows, program_events, program_handle


def _setup(tmp_path, **campaign):
    shutil.copytree(EXAMPLES / "hf-trainer", tmp_path / "hf-trainer", ignore=shutil.ignore_patterns("__pycache__",
                                                                                                     "out"))
    doc = yaml.safe_load((EXAMPLES / "campaign" / "trainer-lr.yaml").read_text())
    doc.update(campaign)
    path = tmp_path / "campaign" / "trainer-lr.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_the_template_puts_the_value_and_seed_on_the_command_line(tmp_path):
    c = load_campaign(_setup(tmp_path))
    assert c.program is not None and c.key == "learning_rate"
    spec = run_spec(c, 3e-3, 2)
    assert spec.program is not None and spec.program.words == [
        "python", "train.py", "--learning_rate", "0.003", "--seed", "2", "--max_steps", "12"]
    assert spec.seed == 2 and spec.model is None  # a program spec: the program builds its own job
    assert run_spec(c, 1e-3, 2).config_hash() != spec.config_hash()
    t = ProgramTemplate(args=["--lr", "{value}"], env={"SEED": "{seed}", "STEPS": "{updates}"})
    assert t.fill(1.0, 7, 30) == (["--lr", "1.0"], {"SEED": "7", "STEPS": "30"})
    with pytest.raises(SpecError) as err:
        run_spec(c, 3e-3, 2, [("train.micro_batch_size", 2)])
    assert "its own arguments" in str(err.value)


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"program": None}, "program", "say how each run's value and seed reach it"),
    ({"program": {"args": ["--learning_rate", "{value}"]}}, "program", "name {seed}"),
    ({"program": {"args": ["--seed", "{seed}"]}}, "program", "no template names {value}"),
    ({"program": {"args": ["--lr", "{value}", "--x", "{epochs}"]}}, "program.args", "names epochs"),
    ({"program": {"args": ["--lr", "{value", "{seed}"]}}, "program.args", "not a template"),
    ({"program": {"args": ["--lr", "{{value}}", "{seed}"]}}, "program", "no template names {value}"),
    ({"program": {"args": ["--lr", "{value:.3g}", "{seed}"]}}, "program.args", "write {value} alone"),
    ({"program": {"args": ["--lr", "{value!r}", "{seed}"]}}, "program.args", "write {value} alone"),
    ({"processes": 2}, "processes", "starts its own processes"),
])
def test_a_program_campaign_that_cannot_run_as_declared_is_refused(tmp_path, change, field, words):
    path = _setup(tmp_path, **change)
    with pytest.raises(SpecError) as err:
        load_campaign(path)
    fields = dict(err.value.problems)
    assert any(f.startswith(field) and words in m for f, m in fields.items()), fields


def test_the_handle_applies_the_stop_rules_at_the_update_that_breaks_one(tmp_path):
    stop_file = tmp_path / "stop"
    job = program_handle(tmp_path, "campaign", stop_file=stop_file,
                         stop_rules=json.dumps({"non_finite": True, "divergence": 3.0}))
    for update, loss in enumerate([2.0, 5.9, 1.0], 1):
        job.update(update, loss=loss, lr=0.1)
        assert not job.should_stop(update)
    job.update(4, loss=6.01, lr=0.1)   # > 3 x the first loss
    assert job.should_stop(4)
    job.evaluated(4, 1.5, accuracy=0.25, note="text is left out")
    [point] = program_events(job, "eval")
    assert point["loss"] == 1.5 and point["metrics"] == {"accuracy": 0.25}

    nan = program_handle(tmp_path / "b", "campaign", stop_file=stop_file, stop_rules=json.dumps({"non_finite": True}))
    nan.update(1, loss=float("nan"), lr=0.1)
    assert nan.should_stop(1)
    kept = program_handle(tmp_path / "c", "campaign", stop_file=stop_file, stop_rules=json.dumps({"non_finite": False}))
    kept.update(1, loss=float("inf"), lr=0.1)
    assert not kept.should_stop(1)
    stop_file.write_text("budget")  # the budget or Ctrl-C: the campaign writes the file
    assert kept.should_stop(2)


# What a campaign worker runs for a program's run, up to the call that starts the program: the worker's module, the
# run's spec read back, the recording function. It must leave torch out (each of --parallel N supervisors would pay a
# second of CPU and a few hundred MB of host memory for a library it never uses).
SUPERVISOR = ("import sys; from pilotrun.campaign import worker; from pilotrun.campaign.program_run import "
              "record_program_run; from pilotrun.workers.common import read_spec_file; "
              "assert read_spec_file(sys.argv[1]).program is not None; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")


@pytest.mark.process
def test_the_process_supervising_a_program_run_never_imports_torch(tmp_path):
    spec = write_spec_file(run_spec(load_campaign(_setup(tmp_path)), 1e-3, 1), tmp_path / "spec.json")
    res = subprocess.run([sys.executable, "-c", SUPERVISOR, str(spec)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


@pytest.mark.process
def test_a_trainer_program_campaign_keeps_every_run_and_stops_the_diverging_one(tmp_path):
    path = _setup(tmp_path)
    ledger = tmp_path / "ledger.sqlite"
    res = pilotrun_cli("campaign", str(path), "--parallel", "2", "--ledger", str(ledger), "--out",
                       str(tmp_path / "runs"), "--json", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    db = sqlite3.connect(ledger)
    db.row_factory = sqlite3.Row
    runs = db.execute("SELECT * FROM runs WHERE kind = 'campaign-run' ORDER BY rowid").fetchall()
    assert len(runs) == 6
    for r in runs:
        meta = json.loads(r["meta_json"])
        points = {s: db.execute("SELECT COUNT(*), MAX(step) FROM metrics WHERE run_id = ? AND gate = ?",
                                (r["run_id"], s)).fetchone() for s in ("train", "val")}
        if meta["variant"] == 3.0:
            # Stopped by the divergence rule at the update that broke it (the program's should_stop): its 3 points
            # are kept, and the row names the loss and the update.
            assert (r["status"], meta["stop_kind"], meta["stopped_at"]) == ("diverged", "divergence", 3), meta
            assert tuple(points["train"]) == (3, 3) and "x the first loss" in meta["stop_reason"]
        else:
            assert r["status"] == "finished" and tuple(points["train"]) == (12, 12)
            # The Trainer's own evaluations (eval_steps=4), reported by the callback.
            assert tuple(points["val"]) == (3, 12) and meta["final"]["step"] == 12
            assert meta["final"]["val_loss"] > 0 and "checkpoint-12" in meta["checkpoint"]
    ids = json.loads(db.execute("SELECT sample_ids_json FROM metrics WHERE gate = 'train' LIMIT 1").fetchone()[0])
    assert len(ids) == 8  # each update's example ids, as the pilot's resume gate reads them
    text = json.loads(res.stdout)["conclusion"]["text"]
    assert any("learning_rate = 3.0 diverged in 2 of 2" in t for t in text), text
    seeds = {json.loads(r["meta_json"])["seed"]: json.loads(r["meta_json"])["final"]["val_loss"] for r in runs
             if json.loads(r["meta_json"])["variant"] == 1e-3}
    assert seeds[1] != seeds[2]  # the seed reached the program: its runs differ


RESUMABLE = """
import argparse, os, time
import torch
import pilotrun

cli = argparse.ArgumentParser()
cli.add_argument("--lr", type=float)
cli.add_argument("--seed", type=int)
cli.add_argument("--updates", type=int)
a = cli.parse_args()
job = pilotrun.program()
torch.manual_seed(a.seed)
x = torch.randn(64, 8)
y = x @ torch.randn(8, 1)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
start = 0
if job.resume_from:
    state = torch.load(job.resume_from, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["update"]
for update in range(start + 1, a.updates + 1):
    if update == 6:  # the test interrupts the campaign here, once update 5 is recorded
        while os.path.exists("hold") and not job.should_stop(5):
            time.sleep(0.05)
        if job.should_stop(5):
            break
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    job.update(update, loss=loss, lr=a.lr, ids=list(range(64)))
    if update % 4 == 0:
        job.evaluated(update, torch.nn.functional.mse_loss(model(x), y))
        path = os.path.join(job.checkpoint_dir or "checkpoints", f"update-{update}.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "update": update}, path)
        job.saved(update, path)
    if job.should_stop(update):
        break
"""


@pytest.mark.process
def test_an_interrupted_program_campaign_continues_from_the_programs_last_checkpoint(tmp_path):
    import os
    import sys

    from tests.conftest import TEST_DIGEST, interrupt_when

    (tmp_path / "prog").mkdir()
    (tmp_path / "prog" / "train.py").write_text(RESUMABLE)
    (tmp_path / "prog" / "hold").write_text("")
    (tmp_path / "prog" / "pilot.yaml").write_text(yaml.safe_dump({"name": "prog",
                                                                  "program": {"command": "python train.py"}}))
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({"name": "sweep", "base": "prog/pilot.yaml", "vary": {"lr": [0.01, 0.02]},
                                    "seeds": [1], "updates": 8,
                                    "program": {"args": ["--lr", "{value}", "--seed", "{seed}", "--updates",
                                                         "{updates}"]}}, sort_keys=False))
    ledger = tmp_path / "ledger.sqlite"
    env = {**os.environ, "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST}

    def points(run_suffix: str) -> list[tuple]:
        rows = polled_rows(ledger, "SELECT step, loss FROM metrics WHERE gate = 'train' AND run_id LIKE ? ORDER BY step",
                           f"%-{run_suffix}")
        return [(r["step"], r["loss"]) for r in rows]

    code, out = interrupt_when([sys.executable, "-m", "pilotrun", "campaign", str(spec), "--ledger", str(ledger),
                                "--out", str(tmp_path / "runs")], lambda: len(points("r01")) >= 5, tmp_path, env)
    assert code == 130, out  # interrupted once updates 1-5 were recorded: the program holds before 6
    first = points("r01")
    (tmp_path / "prog" / "hold").unlink()
    with sqlite3.connect(ledger) as db:
        cid = db.execute("SELECT run_id FROM runs WHERE kind = 'campaign'").fetchone()[0]
    res = pilotrun_cli("campaign", cid, "--resume", "--ledger", str(ledger), "--json", cwd=tmp_path,
                       env={"PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST}, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    with sqlite3.connect(ledger) as db:
        db.row_factory = sqlite3.Row
        rows = {r["run_id"].rsplit("-", 1)[1]: (r["status"], r["parent_id"], json.loads(r["meta_json"]))
                for r in db.execute("SELECT * FROM runs WHERE kind = 'campaign-run'")}
    assert rows["r01"][0] == "stopped" and rows["r01"][2]["checkpoint_update"] == 4
    assert rows["r02"][0] == "not-run"
    status, parent, meta = rows["r03"]
    assert (status, parent) == ("finished", f"{cid}-r01") and meta["continues_from_checkpoint"]["update"] == 4
    resumed = points("r03")
    # It continued from the program's checkpoint after update 4: its update 5 is the interrupted run's update 5.
    assert [s for s, _ in resumed] == [5, 6, 7, 8] and resumed[0] == first[4]
    assert rows["r04"][0] == "finished" and rows["r04"][2]["continues_from_checkpoint"] is None
    assert [s for s, _ in points("r04")] == list(range(1, 9))  # never started: from the start
