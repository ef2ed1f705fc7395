"""Resume you can trust: full-state checkpoints, a fresh-process restore, proof against an uninterrupted run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from pilotrun.checkpoint import CheckpointError, fingerprint_state, manifest_sha256, save_checkpoint
from pilotrun.config import load_spec
from pilotrun.drivers import build_job
from pilotrun.ledger import Ledger
from pilotrun.program.compare import Cause, compare_updates, loop_updates
from pilotrun.program.env import UpdateRecord
from pilotrun.workers.train_phase import restore_check
from tests.conftest import TEST_DIGEST, killed_after_export, pilotrun_cli
from tests.conftest import gate_rows as rows_of


@pytest.mark.process
@pytest.mark.parametrize("bug, gate, words", [
    ("nonpersistent_buffer", "restore", "buffer 'seen': it is registered with persistent=False"),
    ("unseeded_augment", "resume", "not reproducible even without a restart"),
    ("eval_dropout", "reload_eval", "not deterministic in eval mode"),
])
def test_each_bug_fails_its_gate(toylm, tmp_path, bug, gate, words):
    rows = rows_of(toylm, tmp_path, f"model.bug={bug}", f"data.bug={bug}", gates=[gate])
    assert rows[gate]["verdict"] == "fail", rows[gate]["reason"]
    assert words in rows[gate]["reason"]


@pytest.mark.process
def test_nonpersistent_buffer_also_breaks_the_resumed_losses(toylm, tmp_path):
    rows = rows_of(toylm, tmp_path, "model.bug=nonpersistent_buffer", gates=["resume"])
    reason = rows["resume"]["reason"]
    assert rows["resume"]["verdict"] == "fail" and "differs from the uninterrupted one at update 3: loss" in reason
    assert "same examples, different loss" in reason and "persistent=False" in reason
    assert rows["resume"]["details"]["difference"]["cause"] == "state-saved-at-wrong-point"


@pytest.mark.process
def test_correct_setup_restores_and_resumes_bitwise(toylm, tmp_path):
    rows = rows_of(toylm, tmp_path, gates=["restore", "resume", "reload_eval"])
    assert all(r["verdict"] == "pass" for r in rows.values()), {g: r["reason"] for g, r in rows.items()}
    res = rows["resume"]["details"]
    assert res["killed_with"] == "SIGKILL" and res["comparison"] == "bitwise (CPU, fp32)"
    assert [r["step"] for r in res["resumed"]] == [3, 4]
    assert res["control"][2:] == res["resumed"]
    assert rows["restore"]["memory"]["measured_in"] == "the restore process"
    # Everything in a checkpoint loads without pickle: weights_only=True or JSON.
    (ckpt,) = (tmp_path / "out" / "checkpoints").glob("step-*[0-9]")  # the save gate's (after first_step)
    for f in ckpt.iterdir():
        if f.suffix == ".pt":
            torch.load(f, weights_only=True)
        else:
            json.loads(f.read_text())
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["examples_seen"] == 12
    assert state["data_position"] == {**state["data_position"], "epoch": 0, "micro_index": 3, "seed": 5}
    assert set(json.loads((ckpt / "rng.json").read_text())) == {"python", "numpy"}


def _saved(toylm, tmp_path, *overrides):
    spec = load_spec(toylm, list(overrides))
    trainer = build_job(spec)
    for _ in range(3):
        trainer.update()
    expect = fingerprint_state(trainer)
    folder = tmp_path / "ck" / "step-000003"
    save_checkpoint(folder, trainer, spec.canonical())
    trainer.close()
    fresh = build_job(spec)
    return fresh, folder, expect


def test_a_scheduler_left_unrestored_is_named(toylm, tmp_path, monkeypatch):
    """Break pilotrun's own restore on purpose: skip the scheduler."""
    fresh, folder, expect = _saved(toylm, tmp_path, "train.scheduler=cosine")
    monkeypatch.setattr(type(fresh.scheduler), "load_state_dict", lambda self, state: None)
    fields = {m["field"]: m["hint"] for m in restore_check(fresh, folder, expect, {manifest_sha256(folder)})["mismatches"]}
    assert "lr" in fields and "scheduler" in fields
    assert "scheduler state was not restored" in fields["lr"]


def test_a_grad_scaler_left_unrestored_is_named(toylm, tmp_path, monkeypatch):
    fresh, folder, expect = _saved(toylm, tmp_path, "train.precision=fp16")
    monkeypatch.setattr(type(fresh.scaler), "load_state_dict", lambda self, state: None)
    fields = {m["field"]: m["hint"] for m in restore_check(fresh, folder, expect, {manifest_sha256(folder)})["mismatches"]}
    assert "scaler" in fields and "grad scaler" in fields["scaler"]


def test_corrupted_and_untrusted_checkpoints_give_clear_errors(toylm, tmp_path):
    fresh, folder, expect = _saved(toylm, tmp_path)
    # A manifest nobody recorded is refused unless trusted.
    with pytest.raises(CheckpointError, match="not recorded in the ledger.*--trust"):
        restore_check(fresh, folder, expect, known={"0" * 64})
    assert restore_check(fresh, folder, expect, known={"0" * 64}, trust=True)["mismatches"] == []
    # A truncated file is named, before torch ever sees it.
    (opt,) = folder.glob("optimizer-*.pt")
    opt.write_bytes(opt.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"optimizer-00000-of-00001.pt is 100 bytes, the manifest says"):
        restore_check(fresh, folder, expect, {manifest_sha256(folder)})
    # Even when the manifest is not consulted, a damaged file is named, never a deep torch trace.
    from pilotrun.checkpoint import load_torch_file

    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        load_torch_file(opt)


def test_pickled_objects_are_refused(tmp_path):
    from pilotrun.checkpoint import load_torch_file

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        load_torch_file(tmp_path / "evil.pt")


def test_the_loops_records_are_compared_as_a_programs_are():
    """The loop's worker writes floats as hex (exact); the one resume comparison reads them as the program's."""
    a = [{"step": 3, "sample_ids": ["a"], "lr": (0.1).hex(), "loss": (1.0).hex(), "grad_norm": (2.0).hex()},
         {"step": 4, "sample_ids": ["b"], "lr": (0.1).hex(), "loss": (0.5).hex(), "grad_norm": "nan"}]
    assert loop_updates(a)[0] == UpdateRecord(3, ["a"], 1.0, 0.1, 2.0)
    assert compare_updates(loop_updates(a), loop_updates(a), 3, 4, exact=True).equal  # nan equals nan, bitwise
    lr = compare_updates(loop_updates(a), loop_updates([dict(a[0], lr=(0.2).hex()), a[1]]), 3, 4, exact=True)
    assert (lr.difference.update, lr.difference.field, lr.difference.other) == (3, "lr", 0.2)
    assert lr.cause == Cause.SCHEDULER_NOT_RESTORED
    close = loop_updates([dict(a[0], loss=(1.0000001).hex()), a[1]])
    assert compare_updates(loop_updates(a), close, 3, 4, exact=True).cause == Cause.STATE_SAVED_AT_WRONG_POINT
    assert compare_updates(loop_updates(a), close, 3, 4, exact=False, rtol=1e-3).equal
    # A loss that moves only from the second resumed update on: the optimizer's state, as for a program.
    later = loop_updates([a[0], dict(a[1], loss=(0.6).hex())])
    assert compare_updates(loop_updates(a), later, 3, 4, exact=True).cause == Cause.OPTIMIZER_STATE_NOT_RESTORED


@pytest.mark.process
def test_resume_from_the_cli_after_a_real_kill(toylm, tmp_path):
    ledger = tmp_path / "l.sqlite"
    parent = killed_after_export(toylm, tmp_path, ledger)  # after save and export, before restore/resume/overfit
    assert parent["ended_at"] is None
    # A changed config is refused.
    res = pilotrun_cli("run", str(toylm), "--ledger", str(ledger), "--resume", "--set", "train.optimizer.lr=0.5",
                       cwd=tmp_path)
    assert res.returncode == 2 and "the spec changed since run" in res.stderr and "train.optimizer.lr" in res.stderr
    res = pilotrun_cli("run", str(toylm), "--ledger", str(ledger), "--resume", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    gates = {g["gate"]: g for g in report["gates"]}
    assert gates["save"]["details"]["carried_from"] == parent["run_id"]
    assert gates["first_step"]["reason"].startswith(f"carried from {parent['run_id']}")
    assert "restored_step" in gates["load"]["details"]
    for g in ("restore", "resume", "overfit", "reload_eval"):
        assert gates[g]["verdict"] == "pass" and "carried_from" not in gates[g]["details"], g
    with Ledger(ledger) as led:
        assert led.run(report["run_id"])["parent_id"] == parent["run_id"]
    # Nothing left to resume.
    res = pilotrun_cli("run", str(toylm), "--ledger", str(ledger), "--resume", cwd=tmp_path)
    assert res.returncode == 2 and "no interrupted pilot" in res.stderr


def test_buffers_are_compared_with_the_copy_the_strategy_makes_the_state():
    from types import SimpleNamespace

    from pilotrun import strategies
    from pilotrun.checkpoint import compare_fingerprints

    ddp = strategies.get("ddp").buffer_sync(SimpleNamespace(broadcast_buffers=True))
    assert ddp.source_rank == 0 and "broadcast_buffers=True" in ddp.why
    assert strategies.get("ddp").buffer_sync(SimpleNamespace(broadcast_buffers=False)).source_rank is None
    assert strategies.get("fsdp").buffer_sync(SimpleNamespace()).source_rank is None
    assert strategies.get("single").buffer_sync(SimpleNamespace()).source_rank is None
    # Rank 1 saved its own running mean ("own"), rank 0 had "zero"; DDP makes rank 0's copy the state.
    saved = {"buffers": {"bn.running_mean": {"digest": "own", "persistent": True},
                         "scale": {"digest": "s1", "persistent": False}},
             "buffer_sync": {"source_rank": 0, "why": ddp.why,
                             "source_digests": {"bn.running_mean": "zero", "scale": "s1"}}}
    restored = {"buffers": {"bn.running_mean": {"digest": "zero", "persistent": True},
                            "scale": {"digest": "s1", "persistent": False}}}
    assert compare_fingerprints(saved, restored) == []
    restored["buffers"]["bn.running_mean"]["digest"] = "own"  # its own copy back: not what DDP would run with
    (m,) = compare_fingerprints(saved, restored)
    assert m["field"] == "buffer 'bn.running_mean'" and "rank 0's saved copy" in m["hint"]
    assert m["strategy"] == ddp.why
    restored["buffers"]["bn.running_mean"]["digest"] = "zero"
    restored["buffers"]["scale"]["digest"] = "s0"  # a buffer the checkpoint never held is still caught
    (m,) = compare_fingerprints(saved, restored)
    assert m["field"] == "buffer 'scale'" and "persistent=False" in m["hint"]
    # One process (no buffer_sync recorded): each buffer against its own saved digest, as before.
    del saved["buffer_sync"]
    assert [x["field"] for x in compare_fingerprints(saved, restored)] == ["buffer 'bn.running_mean'",
                                                                           "buffer 'scale'"]


@pytest.mark.process
def test_sigterm_is_recorded_as_an_interruption_and_resume_finishes_the_run(toylm, tmp_path):
    # What a spot/preemptible rental's end sends: SIGTERM to pilotrun alone, mid-run.
    ledger = tmp_path / "l.sqlite"
    env = {**os.environ, "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "pilotrun", "run", str(toylm), "--ledger", str(ledger)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("✓ export"):
            proc.send_signal(signal.SIGTERM)  # after save and export, before restore/resume/overfit
            break
    out, err = proc.communicate(timeout=120)
    out = "".join(lines) + out
    assert proc.returncode == 143, out + err
    assert "interrupted (SIGTERM)" in out and "Ctrl-C" not in out + err and "Traceback" not in out + err, out + err
    assert f"pilotrun run {toylm} --resume" in out
    with Ledger(ledger) as led:
        (parent,) = led.runs()
        assert parent["status"] == "interrupted" and parent["ended_at"] is not None
        assert json.loads(parent["meta_json"])["interrupted_by"] == "SIGTERM"
        assert {r["gate"] for r in led.gate_rows(parent["run_id"])} >= {"save", "export"}
    assert json.loads((tmp_path / "runs" / parent["run_id"] / "report.json").read_text())["interrupted_by"] == "SIGTERM"
    res = pilotrun_cli("ledger", "--ledger", str(ledger), cwd=tmp_path)
    assert "interrupted (SIGTERM)" in res.stdout, res.stdout
    # A refused --resume (changed config) leaves no run folder behind.
    res = pilotrun_cli("run", str(toylm), "--ledger", str(ledger), "--resume", "--set", "train.optimizer.lr=0.5",
                       cwd=tmp_path)
    assert res.returncode == 2 and "the spec changed since run" in res.stderr
    assert [p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()] == [parent["run_id"]]
    res = pilotrun_cli("run", str(toylm), "--ledger", str(ledger), "--resume", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["status"] in ("pass", "warn") and "interrupted_by" not in report
    with Ledger(ledger) as led:
        child, again = led.run(report["run_id"]), led.run(parent["run_id"])
        assert child["parent_id"] == parent["run_id"] and child["status"] == report["status"] and child["ended_at"]
        assert again["status"] == "interrupted"  # the parent keeps its own end; the child links to it
    res = pilotrun_cli("ledger", "--ledger", str(ledger), cwd=tmp_path)
    assert f"interrupted (SIGTERM); continued by {report['run_id']}" in res.stdout, res.stdout
