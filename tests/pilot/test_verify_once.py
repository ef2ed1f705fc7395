"""Verify once, use those bytes (issue 45): a file swapped in the window between pilotrun's check and its use is never
used, and a digest pilotrun records is the digest of the bytes it wrote. Each test swaps files in one window — after
a save's rename, between DCP's write and the manifest, after an admission, during a load, during an archive's copy,
before a conversion — as something else that can write the run folder would; one runs a real watcher thread that
keeps swapping while restores run."""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_model

from pilotrun.checkpoint import AtomicFolder, LoadPolicy, LoadRefused, Refusal, save_checkpoint
from pilotrun.checkpoint import io as ckpt_io
from pilotrun.checkpoint import state as ckpt_state
from pilotrun.checkpoint.pinned import pinned
from pilotrun.checkpoint.state import restore_training_state
from pilotrun.checkpoint.trust import LoadPolicy as Policy
from pilotrun.report import archive_files
from pilotrun.strategies.single import Single
from pilotrun.workers import reload as reload_worker
from tests.checkpoint.test_checkpoint_write import Tiny


class Restorable(Tiny):
    def __init__(self, seed: int = 0, step: int = 1) -> None:
        super().__init__(step)
        if seed:
            torch.manual_seed(seed)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(torch.randn_like(p))
        self.loaded: dict | None = None

    def load_state(self, state: dict) -> None:
        self.loaded = state


def _weights(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _swap_after(monkeypatch, module, name: str, swap) -> list:
    """Patch ``module.name`` so that ``swap()`` runs right after the real call returns (once); returns a list that
    records the call."""
    real = getattr(module, name)
    done: list = []

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        if not done:
            done.append(True)
            swap()
        return out

    monkeypatch.setattr(module, name, wrapped)
    return done


# -- what the ledger records -----------------------------------------------------------------------------------

def test_a_manifest_swapped_in_after_the_rename_is_not_the_digest_the_save_records(tmp_path, monkeypatch):
    folder = tmp_path / "step-000001"
    forged = {"format": "pilotrun-checkpoint/1", "files": {}, "note": "the attacker's"}

    def swap():
        # Everything listed again (the files are ours), plus a field: a manifest the attacker wants known.
        real = json.loads((folder / "manifest.json").read_text())
        (folder / "manifest.json").write_text(json.dumps({**real, **{k: v for k, v in forged.items() if k != "files"}}))

    real_rename = os.rename

    def rename_then_swap(src, dst):
        real_rename(src, dst)
        if Path(dst) == folder:
            swap()

    monkeypatch.setattr(ckpt_io.os, "rename", rename_then_swap)
    record = Single().save(folder, Restorable(), {"c": 1}, None, SimpleNamespace())
    monkeypatch.undo()
    now = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    assert record["manifest_sha256"] != now  # the strategy's record (the save row, a campaign's keep) is the write's
    with pytest.raises(LoadRefused) as info:
        LoadPolicy.of([record["manifest_sha256"]]).admit(folder)
    assert info.value.kind is Refusal.UNKNOWN  # the swapped manifest never becomes known


def test_a_dcp_shard_swapped_between_its_write_and_the_manifest_is_not_vouched_for(tmp_path, monkeypatch):
    """The manifest lists the digests DCP's writes had as they went out, so a shard replaced before rank 0 writes the
    manifest makes the folder damaged instead of known."""
    from pilotrun.checkpoint import dist

    folder = tmp_path / "step-000001"
    env = SimpleNamespace(is_main=True, active=False, rank=0, world_size=1, strategy="fsdp2")

    def swap():
        shard = next((folder.parent / ".step-000001.tmp-dist" / "dcp").glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))

    _swap_after(monkeypatch, dist, "_write_small", swap)
    record = dist.save_distributed(folder, Restorable(), {"c": 1}, env)
    manifest = json.loads((folder / "manifest.json").read_bytes())
    assert record["manifest_sha256"] == hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    assert any(name.endswith(".distcp") for name in manifest["files"]) and "dcp/.metadata" in manifest["files"]
    with pytest.raises(LoadRefused) as info:
        LoadPolicy.of([record["manifest_sha256"]]).admit(folder)
    assert info.value.kind is Refusal.DAMAGED and ".distcp" in str(info.value)


# -- restore --------------------------------------------------------------------------------------------------

def _two_checkpoints(tmp_path: Path) -> tuple[Path, Path, dict]:
    ours, theirs = tmp_path / "ck" / "step-000001", tmp_path / "other" / "step-000001"
    trainer = Restorable()
    save_checkpoint(ours, trainer, {"c": 1})
    save_checkpoint(theirs, Restorable(seed=7), {"c": 1})
    return ours, theirs, _weights(trainer)


def _shard(folder: Path) -> Path:
    return next(folder.glob("model-*.pt"))


def test_a_shard_swapped_after_the_admission_is_refused_not_loaded(tmp_path, monkeypatch):
    ours, theirs, _ = _two_checkpoints(tmp_path)
    LoadPolicy.of([hashlib.sha256((ours / "manifest.json").read_bytes()).hexdigest()]).admit(ours)
    os.replace(_shard(theirs), _shard(ours))  # same name, same size: another model's weights
    fresh = Restorable(seed=3)
    before = _weights(fresh)
    with pytest.raises(LoadRefused) as info:
        restore_training_state(fresh, ours)
    assert info.value.kind is Refusal.DAMAGED and _shard(ours).name in str(info.value)
    assert _same(_weights(fresh), before)  # nothing was applied


def test_a_shard_swapped_while_the_restore_reads_is_not_what_it_reads(tmp_path, monkeypatch):
    ours, theirs, saved = _two_checkpoints(tmp_path)
    _swap_after(monkeypatch, ckpt_state, "read_manifest", lambda: os.replace(_shard(theirs), _shard(ours)))
    fresh = Restorable(seed=3)
    restore_training_state(fresh, ours)
    assert _same(_weights(fresh), saved)  # the pinned file, not the one now at its name


def test_a_watcher_swapping_shards_during_restores_never_gets_its_weights_loaded(tmp_path):
    ours, theirs, saved = _two_checkpoints(tmp_path)
    good, evil = _shard(ours).read_bytes(), _shard(theirs).read_bytes()
    target, stop = _shard(ours), threading.Event()
    swaps = [0]

    def watcher():
        while not stop.is_set():
            for data in (evil, good):
                tmp = target.with_name(".swap")
                tmp.write_bytes(data)
                os.replace(tmp, target)
                swaps[0] += 1

    thread = threading.Thread(target=watcher)
    thread.start()
    outcomes = []
    try:
        for seed in range(1, 21):
            fresh = Restorable(seed=seed)
            try:
                restore_training_state(fresh, ours)
            except LoadRefused as exc:
                assert exc.kind is Refusal.DAMAGED
                outcomes.append("refused")
                continue
            assert _same(_weights(fresh), saved), "a restore loaded weights the watcher swapped in"
            outcomes.append("ours")
    finally:
        stop.set()
        thread.join()
    assert swaps[0] > 20 and len(outcomes) == 20


# -- reload: the factory an export names ------------------------------------------------------------------------

def _factory_export(tmp_path: Path) -> tuple[Path, str, Path]:
    code = tmp_path / "code"
    code.mkdir()
    (code / "goodfactory.py").write_text(
        "import torch\n\ndef build(cfg):\n    return torch.nn.Linear(4, 2)\n")
    marker = tmp_path / "MARKER"
    (code / "evilfactory.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n\ndef build(cfg):\n    raise SystemExit\n")
    folder = tmp_path / "export"
    torch.manual_seed(0)
    with AtomicFolder(folder, "export", {"kind": "factory"}) as f:
        f.write_json("export.json", {"factory": "goodfactory:build", "model": {}, "spec_folder": str(code)})
        save_model(torch.nn.Linear(4, 2), str(f.tmp / "model.safetensors"))
        f.adopt_existing()
    assert f.manifest_sha256 is not None
    return folder, f.manifest_sha256, marker


def _evil_export_json(folder: Path) -> None:
    info = json.loads((folder / "export.json").read_text())
    (folder / "export.json").write_text(json.dumps({**info, "factory": "evilfactory:build"}))


def test_an_export_json_swapped_after_the_admission_is_refused_and_its_factory_never_imported(tmp_path, monkeypatch):
    folder, sha, marker = _factory_export(tmp_path)
    _swap_after(monkeypatch, Policy, "admit", lambda: _evil_export_json(folder))
    with pytest.raises(LoadRefused) as info:
        reload_worker.load_artifact(folder, LoadPolicy.of([sha]))
    assert info.value.kind is Refusal.DAMAGED and "export.json" in str(info.value)
    assert not marker.exists()


def test_an_export_json_swapped_while_the_factory_is_read_is_not_the_one_read(tmp_path, monkeypatch):
    folder, sha, marker = _factory_export(tmp_path)
    real_factory = Policy.export_factory

    def swap_then_read(self, adm):
        _evil_export_json(folder)  # the folder, not the view the policy reads
        return real_factory(self, adm)

    monkeypatch.setattr(Policy, "export_factory", swap_then_read)
    model = reload_worker.load_artifact(folder, LoadPolicy.of([sha]))
    assert isinstance(model, torch.nn.Linear) and not marker.exists()


# -- archive and convert --------------------------------------------------------------------------------------

def test_the_archive_packs_the_checked_bytes_even_when_a_file_is_swapped_mid_copy(tmp_path, monkeypatch):
    folder, sha, _ = _factory_export(tmp_path)
    good = (folder / "model.safetensors").read_bytes()
    evil = bytearray(good)
    evil[-1] ^= 0xFF
    real_copy = archive_files.shutil.copyfile

    def swap_then_copy(src, dst, *a, **kw):
        os.replace(_write(tmp_path / "evil.bin", bytes(evil)), folder / "model.safetensors")
        return real_copy(src, dst, *a, **kw)

    monkeypatch.setattr(archive_files.shutil, "copyfile", swap_then_copy)
    dest = tmp_path / "archive" / "model"
    archive_files.pack_manifest_files(folder, dest, tmp_path, sha)
    assert (dest / "model.safetensors").read_bytes() == good


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_dcp_metadata_swapped_after_admission_is_never_unpickled_by_convert(tmp_path, monkeypatch):
    from pilotrun.checkpoint import dist

    folder = tmp_path / "step-000001"
    env = SimpleNamespace(is_main=True, active=False, rank=0, world_size=1, strategy="fsdp2")
    record = dist.save_distributed(folder, Restorable(), {"c": 1}, env)
    marker = tmp_path / "MARKER"

    class Boom:
        def __reduce__(self):
            return (Path.write_text, (marker, "unpickled"))

    import pickle

    def swap():
        (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(Boom()))

    _swap_after(monkeypatch, Policy, "admit", swap)
    with pytest.raises(LoadRefused) as info:
        dist.convert(folder, tmp_path / "out.pt", LoadPolicy.of([record["manifest_sha256"]]))
    assert info.value.kind is Refusal.DAMAGED and not marker.exists()
    monkeypatch.undo()
    # Untouched, the same folder converts (the view is what DCP reads).
    folder2 = tmp_path / "again" / "step-000001"
    record2 = dist.save_distributed(folder2, Restorable(), {"c": 1}, env)
    out = dist.convert(folder2, tmp_path / "again.pt", LoadPolicy.of([record2["manifest_sha256"]]))
    assert Path(out["path"]).is_file()


def test_a_view_names_the_folder_in_its_errors_and_leaves_nothing_behind(tmp_path):
    ours, _, _ = _two_checkpoints(tmp_path)
    with pytest.raises(ckpt_io.CheckpointError) as info:
        with pinned(ours) as view:
            seen = view.folder
            raise ckpt_io.CheckpointError(f"{view.folder / 'rng.pt'} is wrong")
    assert str(ours / "rng.pt") in str(info.value) and not seen.exists()


def test_a_folder_being_written_is_private_until_its_manifest_is_written(tmp_path):
    seen = []
    with AtomicFolder(tmp_path / "export", "export") as f:
        f.write_bytes("a.bin", b"x")
        seen.append(os.stat(f.tmp).st_mode & 0o777)
    assert seen == [0o700]  # a library's files in there are hashed after it closes them: no one else may swap them
    assert os.stat(tmp_path / "export").st_mode & 0o777 == ckpt_io.DIR_MODE


def test_a_file_others_may_write_in_place_is_copied_into_the_view_not_linked(tmp_path):
    """An open file sees writes into its inode: where someone else may write it, the view holds the hashed bytes."""
    ours, _, _ = _two_checkpoints(tmp_path)
    shared, private = _shard(ours), next(ours.glob("optimizer-*.pt"))
    shared.chmod(0o664)
    private.chmod(0o644)
    with pinned(ours) as view:
        assert not (view.folder / shared.name).is_symlink()
        assert (view.folder / shared.name).read_bytes() == shared.read_bytes()
        assert (view.folder / private.name).is_symlink()  # this user's own file: the inode itself, no copy
        assert not (view.folder / "trainer_state.json").is_symlink()  # JSON: read by a reader that refuses links


def test_a_listed_file_replaced_by_a_link_is_named_as_a_link(tmp_path):
    ours, theirs, _ = _two_checkpoints(tmp_path)
    shard = _shard(ours)
    copy = tmp_path / "copy.pt"
    copy.write_bytes(shard.read_bytes())  # the same bytes, outside the folder
    shard.unlink()
    shard.symlink_to(copy)
    with pytest.raises(LoadRefused) as info:
        with pinned(ours):
            pass
    assert info.value.kind is Refusal.DAMAGED and f"{shard.name} is a symbolic link" in str(info.value)
