"""``run --resume`` finds the right state or says why not: damage named file by file, never another config's
checkpoint, every state-file error under ``--trust`` named with its file and field."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from pilotrun.checkpoint import LoadPolicy
from tests.checkpoint.test_loading_policy import GATES, _rehash, _resume, flat, killed_parent, parent  # noqa: F401  (fixtures)
from tests.conftest import killed_after_export, pilotrun_cli

pytestmark = pytest.mark.process

SHARD = "model-00000-of-00001.pt"


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:-100])


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _to_dev_zero(f: Path) -> None:
    f.unlink()
    f.symlink_to("/dev/zero")


DAMAGE = [  # (what is done to the only checkpoint, words the refusal must contain)
    ("truncated", lambda c: _truncate(c / SHARD), [SHARD, "bytes, the manifest says", "truncated"]),
    ("byte-flipped", lambda c: _flip(c / SHARD), [SHARD, "does not match its blake3", "same size"]),
    ("renamed", lambda c: (c / SHARD).rename(c / "model-old.pt"),
     [f"{SHARD} is listed in the manifest", "missing (deleted or renamed)", "model-old.pt is not in the manifest"]),
    ("deleted", lambda c: (c / SHARD).unlink(), [f"{SHARD} is listed in the manifest", "missing"]),
    ("manifest missing", lambda c: (c / "manifest.json").unlink(), ["manifest.json is missing"]),
    ("manifest garbage", lambda c: (c / "manifest.json").write_text("{not json"), ["manifest.json is unreadable"]),
    ("dev-zero link", lambda c: _to_dev_zero(c / SHARD), [f"{SHARD} is a symbolic link (to /dev/zero)"]),
]


def _each_altered(ckpt: Path, tmp_path: Path, cases: list):
    """Each case applied to a fresh copy of the pristine checkpoint, in its place."""
    pristine = tmp_path / "pristine"
    shutil.copytree(ckpt, pristine)
    for name, alter, words in cases:
        shutil.rmtree(ckpt)
        shutil.copytree(pristine, ckpt)
        alter(ckpt)
        yield name, words


def test_each_damage_to_the_only_checkpoint_is_named_and_exit_2(parent, tmp_path):  # noqa: F811
    ckpt = parent["ckpt"]
    for what, words in _each_altered(ckpt, tmp_path, DAMAGE):
        res = _resume(parent, tmp_path)
        assert res.returncode == 2, (what, res.stdout[-1500:], res.stderr)
        err = flat(res.stderr)
        assert f"run {parent['run']['run_id']} has no usable checkpoint (1 checked" in err, (what, res.stderr)
        for w in words:
            assert w in err, (what, w, res.stderr)
        assert "starts over" not in res.stdout + res.stderr and "Traceback" not in res.stderr, what


def test_a_damaged_newest_checkpoint_names_the_older_one_it_resumes(parent, tmp_path):  # noqa: F811
    ckpt = parent["ckpt"]  # the intact, recorded one; a newer one beside it, damaged after its save
    newer = ckpt.with_name("step-000002")  # (a copy under its own step: a renamed folder is refused for its name)
    shutil.copytree(ckpt, newer)
    _opt_in(newer, "trainer_state.json", lambda s: s.update(step=2))
    manifest = json.loads((newer / "manifest.json").read_text())
    (newer / "manifest.json").write_text(json.dumps({**manifest, "step": 2}, indent=1, sort_keys=True))
    _flip(newer / "optimizer-00000-of-00001.pt")
    res = _resume(parent, tmp_path)
    out = flat(res.stdout + res.stderr)
    assert res.returncode == 0, out[-3000:]
    assert "not resumed from step-000002" in out and "optimizer-00000-of-00001.pt does not match its sha256" in out
    assert "step-000001 is intact and usable: resuming from it" in out


def test_resume_never_loads_the_checkpoint_of_another_spec_sharing_the_out_folder(toylm, tmp_path):
    ledger, shared = tmp_path / "l.sqlite", tmp_path / "shared"
    spec_b = toylm.with_name("b.yaml")
    spec_b.write_text(toylm.read_text().replace("name: toylm", "name: toylm-b").replace("lr: 0.01", "lr: 0.02"))
    parent_b = killed_after_export(spec_b, tmp_path, ledger, "--gates", GATES, "--out", str(shared))
    res = pilotrun_cli("run", str(toylm), "--ledger", str(ledger), "--out", str(shared), "--gates", "save", "--json",
                       cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    run_a = json.loads(res.stdout)["run_id"]
    res = pilotrun_cli("run", str(spec_b), "--ledger", str(ledger), "--resume", "--gates", GATES, cwd=tmp_path)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr
    err = flat(res.stderr)
    assert f"run {parent_b['run_id']} has no usable checkpoint" in err
    assert "was written for config hash" in err and f"spec 'toylm', run {run_a}" in err, res.stderr
    assert "never resumed across configs" in err


def _opt_in(ckpt: Path, name: str, edit) -> None:
    path = ckpt / name
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    _rehash(ckpt)


def _wrong_tensor(ckpt: Path) -> None:
    payload = torch.load(ckpt / SHARD, weights_only=True)
    key = next(iter(payload["entries"]))
    payload["entries"][key] = torch.zeros(3, 3)
    torch.save(payload, ckpt / SHARD)
    _rehash(ckpt)


TRUSTED_EDITS = [  # (file, what is done, words the load gate's reason must contain)
    ("scheduler.json", lambda c: _opt_in(c, "scheduler.json", lambda s: s.pop("lr_lambdas")),
     "scheduler.json: field lr_lambdas is missing"),
    ("trainer_state.json", lambda c: _opt_in(c, "trainer_state.json", lambda s: s.update(step="three")),
     "trainer_state.json: field step is 'three', expected a number"),
    ("rng.json", lambda c: _opt_in(c, "rng.json", lambda s: s["python"].update(state=[1, 2])),
     "rng.json: field python.state is 2 items"),
    (SHARD, _wrong_tensor, f"{SHARD}: entry"),
]


def test_under_trust_each_altered_state_file_is_named_with_its_field(parent, tmp_path):  # noqa: F811
    ckpt = parent["ckpt"]
    for i, (name, words) in enumerate(_each_altered(ckpt, tmp_path, TRUSTED_EDITS)):
        if i == 0:  # unrecorded now (the manifest was rewritten): refused without --trust, naming why (one
            # check of the manifest hash, whichever file changed)
            res = _resume(parent, tmp_path)
            assert res.returncode == 2 and "not recorded in the ledger" in flat(res.stderr), (name, res.stderr)
            assert "pass --trust" in flat(res.stderr), name
        res = _resume(parent, tmp_path, "--trust", "--json")
        assert res.returncode == 1, (name, res.stdout[-2000:], res.stderr)
        load = {g["gate"]: g for g in json.loads(res.stdout)["gates"]}["load"]
        assert load["verdict"] == "fail" and words in load["reason"], (name, load["reason"])
        assert "KeyError" not in load["reason"] and "JSONDecodeError" not in load["reason"]


def test_an_altered_expect_file_is_named_by_the_restore_gate(parent, tmp_path):  # noqa: F811
    expect = parent["ckpt"].with_name("step-000001.expect.json")
    expect.write_text(expect.read_text()[:-40])  # cut mid-way: not JSON any more
    res = _resume(parent, tmp_path, "--trust", "--json")
    rows = {g["gate"]: g for g in json.loads(res.stdout)["gates"]}
    assert rows["restore"]["verdict"] == "fail", rows["restore"]["reason"]
    # Its bytes are not those the save recorded: refused before they are parsed (a cut file is not JSON either).
    assert "step-000001.expect.json is not the file the save wrote" in rows["restore"]["reason"], rows["restore"]["reason"]
    assert os.path.basename(str(expect)) in rows["restore"]["reason"]


def test_an_expect_file_rewritten_as_valid_json_is_not_compared(parent, tmp_path):  # noqa: F811
    # The fingerprints lie beside the checkpoint, outside its manifest: rewritten to agree with a broken restore they
    # would make it pass. The save row records their sha256; the restore reads only those bytes.
    expect = parent["ckpt"].with_name("step-000001.expect.json")
    fingerprints = json.loads(expect.read_text())
    fingerprints["step"] = fingerprints["step"] + 1
    expect.write_text(json.dumps(fingerprints, sort_keys=True))
    res = _resume(parent, tmp_path, "--json")
    rows = {g["gate"]: g for g in json.loads(res.stdout)["gates"]}
    reason = rows["restore"]["reason"]
    assert rows["restore"]["verdict"] == "fail" and "is not the file the save wrote" in reason, reason
    assert "changed after the save; not compared" in reason and "differ from what was saved" not in reason, reason


def _plan(p: dict):
    from pilotrun.config import load_spec
    from pilotrun.ledger import Ledger
    from pilotrun.pilot.resume import plan_resume

    spec = load_spec(p["spec"])
    with Ledger(p["ledger"]) as led:
        return plan_resume(led, spec.name, p["run"]["run_id"], False, spec.canonical(), spec.config_hash())


def test_a_renamed_or_linked_checkpoint_folder_is_refused_with_why(parent, tmp_path):  # noqa: F811
    from pilotrun.pilot.resume import ResumeError

    ckpt = parent["ckpt"]
    renamed = ckpt.with_name("step-000009")  # recorded bytes, under a step it never was
    ckpt.rename(renamed)
    with pytest.raises(ResumeError) as info:
        _plan(parent)
    assert "step-000009: its manifest records step 1, not 9" in flat(str(info.value)), info.value
    outside = tmp_path / "elsewhere"
    renamed.rename(outside)
    ckpt.symlink_to(outside, target_is_directory=True)  # the recorded name, pointing out of the run
    with pytest.raises(ResumeError) as info:
        _plan(parent)
    assert f"step-000001 is a symbolic link (to {outside})" in flat(str(info.value)), info.value


def test_state_files_out_of_range_or_not_the_jobs_are_named_before_they_are_applied(parent):  # noqa: F811
    """What --trust lets load is still checked against the job: a step of 1e30, a config.json replaced."""
    from pilotrun.checkpoint.io import CheckpointError
    from pilotrun.checkpoint.state import restore_training_state
    from pilotrun.config import load_spec
    from pilotrun.drivers import build_job

    ckpt = parent["ckpt"]
    pristine = ckpt.with_name("pristine")
    shutil.copytree(ckpt, pristine)
    driver = build_job(load_spec(parent["spec"]))
    try:
        cases = [("trainer_state.json", lambda s: s.update(step=10**30), "trainer_state.json: field step is 1" + "0" * 30),
                 ("trainer_state.json", lambda s: s.update(step=0), "field step is 0, but"),
                 ("config.json", lambda s: s["train"]["optimizer"].update(lr=0.5), "config.json hashes to config")]
        for name, edit, words in cases:
            shutil.rmtree(ckpt)
            shutil.copytree(pristine, ckpt)
            _opt_in(ckpt, name, edit)
            # As run --resume --trust does: admitted (unknown, allowed), then restored from a view of what was admitted.
            LoadPolicy.of((), trust=True).admit(ckpt)
            with pytest.raises(CheckpointError) as info:
                restore_training_state(driver, ckpt)
            assert words in str(info.value), (name, str(info.value))
    finally:
        driver.close()
