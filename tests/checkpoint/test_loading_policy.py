"""One loading policy: nothing unknown is unpickled or imported, every damaged file is named, no wrong-config resume.

Each tampering case is a real attack on the real command line: a crafted DCP ``.metadata`` pickle, an export
whose ``export.json`` names a marker-writing module, planted links and files. The payloads write a marker file
when executed; the tests assert the marker never appears.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pilotrun.checkpoint import LoadPolicy, LoadRefused, Refusal
from pilotrun.ledger import Ledger
from tests.conftest import copy_fixture, killed_after_export, pilotrun_cli

pytestmark = pytest.mark.process


class _Payload:
    """Unpickling this runs ``exec``: it writes the marker file (what a crafted .metadata would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('unpickled')",))


def _rehash(folder: Path, **fields) -> None:
    """Rewrite ``folder``'s manifest so it matches the files on disk again (what an attacker would do)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            files[str(p.relative_to(folder))] = {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                                                 "bytes": p.stat().st_size}
    manifest.update(fields, files=files)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _plant_dcp(folder: Path, marker: Path) -> None:
    (folder / "dcp").mkdir(exist_ok=True)
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _rehash(folder, layout="dcp", world_size=1)


GATES = "save,export,restore,reload_eval"


@pytest.fixture(scope="module")
def killed_parent(tmp_path_factory):
    """A real pilot of the user-LM fixture killed after its export, run once for the module: its folder (spec,
    ledger, run folder) and a pristine copy of it."""
    work = tmp_path_factory.mktemp("parent")
    spec = copy_fixture("toylm", work)
    run = killed_after_export(spec, work, work / "l.sqlite", "--gates", GATES)
    pristine = tmp_path_factory.mktemp("parent-pristine") / "copy"
    shutil.copytree(work, pristine, symlinks=True)
    return work, pristine, spec, run


@pytest.fixture
def parent(killed_parent):
    """The killed parent as the kill left it: every test damages or resumes it, so each gets the pristine copy back
    in its place (the ledger and the run folder are where the ledger says they are)."""
    work, pristine, spec, run = killed_parent
    shutil.rmtree(work)
    shutil.copytree(pristine, work, symlinks=True)
    ckpt = Path(run["out_dir"]) / "checkpoints" / "step-000001"
    assert (ckpt / "manifest.json").is_file()
    return {"spec": spec, "ledger": work / "l.sqlite", "run": run, "ckpt": ckpt, "out": Path(run["out_dir"])}


def _resume(p: dict, tmp_path: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``run --resume=PARENT``: the parent by id, so a test can resume it again after a resume that ran."""
    return pilotrun_cli("run", str(p["spec"]), "--ledger", str(p["ledger"]), f"--resume={p['run']['run_id']}",
                        "--gates", GATES, *extra, cwd=tmp_path, env=env, timeout=300)


def flat(text: str) -> str:
    """The console wraps long lines: compare messages with whitespace collapsed."""
    return " ".join(text.split())


# -- deliverable 1: nothing unknown is unpickled or imported --------------------------------------------------

def test_convert_never_unpickles_the_metadata_of_an_unrecorded_folder(tmp_path):
    marker = tmp_path / "MARKER"
    folder = tmp_path / "step-000004"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "manifest.json").write_text(json.dumps({"format": "pilotrun-checkpoint/1", "files": {}}))
    _plant_dcp(folder, marker)
    ledger = tmp_path / "l.sqlite"
    Ledger(ledger).close()
    # The ledger through the environment: the same command line reaches convert on code without --ledger.
    res = pilotrun_cli("convert", str(folder), "--out", str(tmp_path / "c.pt"), cwd=tmp_path,
                       env={"PILOTRUN_LEDGER": str(ledger)})
    assert not marker.exists(), "the crafted .metadata was unpickled"
    assert res.returncode == 2, res.stderr
    assert "is a pickle" in flat(res.stderr) and "not recorded in the ledger" in flat(res.stderr), res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "c.pt").exists()
    # Without any ledger: exit 2 with the fix, nothing read.
    res = pilotrun_cli("convert", str(folder), "--out", str(tmp_path / "c.pt"), "--ledger", str(tmp_path / "none"),
                       cwd=tmp_path)
    assert res.returncode == 2 and "no ledger at" in flat(res.stderr) and not marker.exists()


def test_resume_with_trust_never_unpickles_dcp_metadata(parent, tmp_path):
    marker = tmp_path / "MARKER"
    _plant_dcp(parent["ckpt"], marker)
    res = _resume(parent, tmp_path, "--trust")
    assert not marker.exists(), "the crafted .metadata was unpickled"
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr
    assert "dcp/.metadata is a pickle" in flat(res.stderr) and "never unpickles an unknown file" in flat(res.stderr)
    assert "Traceback" not in res.stderr


def test_resume_never_imports_a_factory_named_by_a_rewritten_export(parent, tmp_path):
    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n"
                                     "def boom(mapping):\n    raise SystemExit('ran')\n")
    export = parent["out"] / "export"
    info = json.loads((export / "export.json").read_text())
    (export / "export.json").write_text(json.dumps({**info, "factory": "evilmod:boom", "spec_folder": str(evil)}))
    _rehash(export)
    res = _resume(parent, tmp_path, "--json", env={"PYTHONPATH": f"{evil}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert not marker.exists(), "the module an artifact named was imported"
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    gates = {g["gate"]: g for g in json.loads(res.stdout)["gates"]}
    # The rewritten export is not carried: it no longer matches the manifest its row recorded; it is written again.
    assert "carried_from" not in gates["export"]["details"]
    assert gates["save"]["details"]["carried_from"] == parent["run"]["run_id"]
    assert gates["reload_eval"]["verdict"] == "pass", gates["reload_eval"]["reason"]
    # The parent's rewritten export stays where it is, never loaded; this run wrote its own.
    new_export = tmp_path / gates["export"]["details"]["path"]  # relative to the run's working folder
    assert new_export != export and json.loads((new_export / "export.json").read_text())["factory"] == "toylm:build_model"


def test_the_reload_worker_refuses_an_unrecorded_export_and_a_factory_it_was_not_given(tmp_path, toylm):
    marker = tmp_path / "MARKER"
    (tmp_path / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"")
    (export / "export.json").write_text(json.dumps({"factory": "evilmod:x", "model": {}, "spec_folder": str(tmp_path)}))
    (export / "manifest.json").write_text(json.dumps({"format": "pilotrun-export/1", "files": {}}))
    _rehash(export)
    sha = hashlib.sha256((export / "manifest.json").read_bytes()).hexdigest()
    with pytest.raises(LoadRefused) as info:
        LoadPolicy.of({"0" * 64}).admit(export)
    assert info.value.kind == Refusal.UNKNOWN
    trusted = LoadPolicy.of(set(), trust=True, factory="toylm:build_model")
    with pytest.raises(LoadRefused) as info:
        trusted.export_factory(trusted.admit(export))
    assert info.value.kind == Refusal.FACTORY and "evilmod:x" in str(info.value)
    assert LoadPolicy.of({sha}).export_factory(LoadPolicy.of({sha}).admit(export)) == "evilmod:x"  # known: allowed
    # The real worker process, given the recorded hash of another export: refuses before importing anything.
    result = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "pilotrun.workers.reload", "--export", str(export), "--inputs",
                           str(tmp_path / "in.safetensors"), "--outputs", str(tmp_path / "out.safetensors"),
                           "--known-manifest", "0" * 64, "--factory", "toylm:build_model", "--result", str(result)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and "not recorded in the ledger" in json.loads(result.read_text())["error"]
    assert not marker.exists()


def test_archive_packs_exactly_the_manifest_and_never_follows_links(toylm, tmp_path):
    ledger = tmp_path / "l.sqlite"
    res = pilotrun_cli("run", str(toylm), "--ledger", str(ledger), "--gates", "lock,export", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    run_id = json.loads(res.stdout)["run_id"]
    export = tmp_path / "runs" / run_id / "export"
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the run folder\n")
    (export / "planted.pkl").write_bytes(pickle.dumps({"x": 1}))
    (export / "link.txt").symlink_to(secret)
    out = tmp_path / "a.tar.gz"
    res = pilotrun_cli("archive", run_id, "--ledger", str(ledger), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "not packed (not in the model's manifest): link.txt, planted.pkl" in flat(res.stdout)
    with tarfile.open(out) as tar:
        names = tar.getnames()
        members = tar.getmembers()
        contents = b"".join(tar.extractfile(m).read() for m in members if m.isfile())  # type: ignore[union-attr]
    assert not any(n.endswith(("planted.pkl", "link.txt")) for n in names), names
    assert not any(m.issym() or m.islnk() for m in members) and b"outside the run folder" not in contents
    model = sorted(n.split("/model/")[1] for n in names if "/model/" in n)
    assert model == sorted([*json.loads((export / "manifest.json").read_text())["files"], "manifest.json"])
    # A listed file replaced by a link to identical bytes outside the run: refused, never followed.
    weights = export / "model.safetensors"
    copy = tmp_path / "weights-copy.safetensors"
    shutil.copyfile(weights, copy)
    weights.unlink()
    weights.symlink_to(copy)
    res = pilotrun_cli("archive", run_id, "--ledger", str(ledger), "--out", str(tmp_path / "b.tar.gz"), cwd=tmp_path)
    assert res.returncode == 2 and "model.safetensors is a symbolic link" in flat(res.stderr), res.stderr
    assert not (tmp_path / "b.tar.gz").exists() and "Traceback" not in res.stderr
    # The factory's code is the one file the run's lock recorded, from the spec's folder: nothing else there.
    assert sorted(n.split("/code/")[1] for n in names if "/code/" in n) == ["toylm.py"], names
    # That file changed since the run: left out and named, never packed as if it were the run's.
    weights.unlink()
    shutil.copyfile(copy, weights)
    (toylm.parent / "toylm.py").write_text((toylm.parent / "toylm.py").read_text() + "\n# edited after the run\n")
    res = pilotrun_cli("archive", run_id, "--ledger", str(ledger), "--out", str(tmp_path / "c.tar.gz"), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "toylm.py (changed since the run's lock recorded it" in flat(res.stdout), res.stdout
    with tarfile.open(tmp_path / "c.tar.gz") as tar:
        assert not any("/code/" in n for n in tar.getnames())
        readme = tar.extractfile(f"{run_id}/README.md").read().decode()  # type: ignore[union-attr]
    assert "## Left out" in readme and "toylm.py" in readme.split("## Left out")[1]


def test_the_dcp_reader_itself_refuses_a_folder_not_admitted_as_known(toylm, tmp_path):
    """The last line of defence, right at the unpickling call: restore_distributed on a planted folder."""
    from types import SimpleNamespace

    from pilotrun.checkpoint.dist import restore_distributed
    from pilotrun.config import load_spec
    from pilotrun.drivers import build_job

    marker = tmp_path / "MARKER"
    folder = tmp_path / "step-000002"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"format": "pilotrun-checkpoint/1", "files": {}}))
    _plant_dcp(folder, marker)
    driver = build_job(load_spec(toylm))
    try:
        with pytest.raises(LoadRefused) as info:
            restore_distributed(driver, folder, SimpleNamespace(world_size=1, rank=0))
        assert info.value.kind == Refusal.PICKLE and not marker.exists()
        # Admitted under --trust is still not known: refused at admission, never reaching torch.
        with pytest.raises(LoadRefused) as info:
            LoadPolicy.of(set(), trust=True).admit(folder)
        assert info.value.kind == Refusal.PICKLE and not marker.exists()
    finally:
        driver.close()
