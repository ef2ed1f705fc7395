"""A save hashes each file as it writes it, writes shards in parallel, fsyncs each file once behind the next one's
writes, and can run behind the job from a host copy (issue 25). Manifests written before still verify."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import blake3
import pytest
import torch

from pilotrun.checkpoint import (
    AtomicFolder,
    CheckpointError,
    latest_checkpoint,
    manifest_sha256,
    save_checkpoint,
    start_checkpoint,
    verify_folder,
)
from pilotrun.checkpoint import digest as ckpt_digest
from pilotrun.checkpoint import io as ckpt_io
from pilotrun.checkpoint.state import _load_sharded


class Tiny:
    """The attributes a save reads from a trainer, on a model of a few hundred parameters."""

    def __init__(self, step: int = 1) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.model(torch.randn(3, 8)).sum().backward()
        self.optimizer.step()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: 1.0)
        self.scaler = None
        self.step = step

    def state(self) -> dict:
        return {"step": self.step, "examples_seen": 3, "data_position": {"epoch": 0, "micro_index": 1}}


def test_a_checkpoint_records_blake3_per_file_and_its_identity_stays_the_manifest_sha256(tmp_path):
    folder = tmp_path / "step-000001"
    written = save_checkpoint(folder, Tiny(), {"c": 1})
    manifest = verify_folder(folder)
    for name, info in manifest["files"].items():
        assert set(info) == {"blake3", "bytes"}, name
        assert info["blake3"] == blake3.blake3((folder / name).read_bytes()).hexdigest(), name
    # The ledger's "known": the sha256 of the manifest's bytes, as the save computed it while writing them.
    raw = (folder / "manifest.json").read_bytes()
    assert written.manifest_sha256 == manifest_sha256(folder) == hashlib.sha256(raw).hexdigest()


def test_nothing_is_read_back_to_hash_it(tmp_path, monkeypatch):
    def no_read_back(path, algo):
        raise AssertionError(f"{path} was read back to hash it")

    monkeypatch.setattr(ckpt_io, "file_digest", no_read_back)
    monkeypatch.setattr(ckpt_digest, "file_digest", no_read_back)
    save_checkpoint(tmp_path / "step-000001", Tiny(), {"c": 1})
    monkeypatch.undo()
    verify_folder(tmp_path / "step-000001")


def _as_before_issue_25(folder: Path) -> None:
    """Rewrite the manifest as every save before issue 25 wrote it: sha256 for each file."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"] = {name: {"sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
                                "bytes": info["bytes"]} for name, info in manifest["files"].items()}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("old", [False, True], ids=["blake3", "sha256 (before issue 25)"])
def test_a_byte_flipped_after_the_write_is_caught_whatever_the_manifest_s_digest(tmp_path, old):
    folder = tmp_path / "step-000001"
    save_checkpoint(folder, Tiny(), {"c": 1})
    if old:
        _as_before_issue_25(folder)
    verify_folder(folder)
    _flip(folder / "model-00000-of-00001.pt")
    algo = "sha256" if old else "blake3"
    with pytest.raises(CheckpointError, match=f"model-00000-of-00001.pt does not match its {algo} in the manifest"):
        verify_folder(folder)


@pytest.mark.parametrize("entry", [{"bytes": 3}, {"bytes": 3, "sha256": "a", "blake3": "b"}, {"bytes": 3, "md5": "a"},
                                   {"bytes": "3", "blake3": "b"}])
def test_an_entry_without_exactly_one_known_digest_is_a_damaged_manifest(tmp_path, entry):
    folder = tmp_path / "step-000001"
    save_checkpoint(folder, Tiny(), {"c": 1})
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["config.json"] = entry
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="one of sha256 or blake3"):
        verify_folder(folder)


def test_shards_are_written_at_the_same_time(tmp_path):
    # Each of two shards waits inside its write until the other is being written too: one writer thread would
    # never get past the barrier.
    together = threading.Barrier(2, timeout=10)

    def slow_save(obj, fh):
        fh.write(b"begun")
        together.wait()
        torch.save(obj, fh)

    with AtomicFolder(tmp_path / "step-000001", "checkpoint", threads=2) as f:
        f.submit("a.pt", slow_save, {"w": torch.zeros(4)})
        f.submit("b.pt", slow_save, {"w": torch.ones(4)})
    assert set(verify_folder(tmp_path / "step-000001")["files"]) == {"a.pt", "b.pt"}


def test_each_file_is_fsynced_once_behind_the_writes_and_the_manifest_after_all(tmp_path, monkeypatch):
    synced: list[tuple[str, str]] = []
    real = os.fsync

    def record(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), threading.current_thread().name))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    folder = tmp_path / "step-000001"
    save_checkpoint(folder, Tiny(), {"c": 1})
    monkeypatch.undo()
    names = [Path(p).name for p, _ in synced]
    files = sorted(verify_folder(folder)["files"])
    assert sorted(names[:len(files)]) == files  # each file once, before anything else
    assert names[len(files):] == ["manifest.json", f".{folder.name}.tmp-{os.getpid()}", folder.parent.name]
    # A file's flush runs on the flusher, never on the thread that writes the next file.
    assert {thread for _, thread in synced[:len(files)]} == {"pilotrun-fsync_0"}


def test_a_full_disk_in_a_writer_thread_fails_the_save_and_leaves_no_folder(tmp_path, monkeypatch):
    real = ckpt_io.HashingWriter.write

    def full_for_shards(self, data):
        if self.path.suffix == ".pt":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    monkeypatch.setattr(ckpt_io.HashingWriter, "write", full_for_shards)
    with pytest.raises(Exception) as info:
        save_checkpoint(tmp_path / "step-000001", Tiny(), {"c": 1})
    assert ckpt_io.disk_full_error(info.value) is not None, repr(info.value)
    assert list(tmp_path.iterdir()) == []


def test_a_background_save_writes_the_state_as_it_was_when_it_returned(tmp_path):
    trainer = Tiny()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = trainer.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    folder = tmp_path / "step-000001"
    pending = start_checkpoint(folder, trainer, {"c": 1})
    # The job goes on at once: an update changes the weights and the moments in place.
    trainer.model(torch.randn(3, 8)).sum().backward()
    trainer.optimizer.step()
    record = pending.wait()
    assert pending.behind and pending.total_seconds is not None and pending.blocking_seconds is not None
    assert set(record["files"]) == set(verify_folder(folder)["files"])
    weights, _ = _load_sharded(folder, "model")
    assert all(torch.equal(weights[k], before[k]) for k in before)
    assert not torch.equal(trainer.model[0].weight.detach(), before["0.weight"])
    optimizer, _ = _load_sharded(folder, "optimizer")
    assert torch.equal(optimizer[0]["exp_avg"], moments)


def test_a_background_save_keeps_tied_weights_one_tensor(tmp_path):
    trainer = Tiny()
    trainer.model[1].weight = torch.nn.Parameter(torch.zeros(2, 8))
    trainer.model.add_module("head", torch.nn.Linear(8, 2, bias=False))
    trainer.model.head.weight = trainer.model[1].weight  # tied, as tie_word_embeddings does
    folder = tmp_path / "step-000001"
    start_checkpoint(folder, trainer, {"c": 1}).wait()
    weights, _ = _load_sharded(folder, "model")
    assert weights["head.weight"].untyped_storage().data_ptr() == weights["1.weight"].untyped_storage().data_ptr()


SLOW_BACKGROUND_SAVER = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from pilotrun.checkpoint import io, save_checkpoint, start_checkpoint
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint_write import Tiny

    root = Path(sys.argv[1])
    trainer = Tiny()
    save_checkpoint(root / "step-000001", trainer, {"c": 1})
    real = io.HashingWriter.write

    def slow(self, data):  # the background write takes minutes: the kill lands in the middle of it
        if self.path.suffix == ".pt":
            time.sleep(0.5)
        return real(self, data)

    io.HashingWriter.write = slow
    trainer.step = 2
    pending = start_checkpoint(root / "step-000002", trainer, {"c": 1})
    print("returned", flush=True)
    while True:  # the job goes on training while its checkpoint is written
        trainer.model(torch.randn(3, 8)).sum().backward()
        trainer.optimizer.step()
        time.sleep(0.01)
""")


@pytest.mark.process
def test_a_sigkill_during_a_background_save_keeps_the_previous_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SLOW_BACKGROUND_SAVER, str(tmp_path), str(Path(__file__).parent)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout.readline().strip() == "returned", proc.stderr.read()
        deadline = time.time() + 30
        while time.time() < deadline and not list(tmp_path.glob(".step-000002.tmp-*/*.pt")):
            time.sleep(0.01)
        assert list(tmp_path.glob(".step-000002.tmp-*/*.pt")), "the background write never began"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "step-000002").exists()  # the half-written one never took the name
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    assert verify_folder(tmp_path / "step-000001")["step"] == 1


def test_the_save_row_keeps_what_the_job_waited_apart_from_the_whole_save(toylm, tmp_path, monkeypatch):
    from pilotrun.config import load_spec
    from pilotrun.pilot import PilotOptions, run_pilot
    from pilotrun.strategies import single

    # As on an accelerator: the job waits for the host copy, a thread writes the rest.
    monkeypatch.setattr(single, "saves_behind", lambda device: True)
    result = run_pilot(load_spec(toylm), PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "l.sqlite",
                                                      gates=["save"]))
    save = {r["gate"]: r for r in result.rows}["save"]
    details = save["details"]
    assert save["verdict"] == "pass", save["reason"]
    assert 0 < details["blocking_seconds"] <= details["write_seconds"]
    assert details["blocking_bytes_per_second"] == pytest.approx(details["bytes"] / details["blocking_seconds"])
    assert "the job waited" in save["reason"] and "(the copy to host memory)" in save["reason"]
    verify_folder(Path(details["path"]))


def test_the_plan_charges_a_checkpoint_what_the_job_waited_and_an_export_the_write(tmp_path):
    from pilotrun.config import load_spec
    from pilotrun.estimate.plan import pipeline_hours
    from pilotrun.ledger.store import Ledger
    from tests.conftest import EXAMPLES
    from tests.estimate.test_estimate import synthetic_trace

    spec = load_spec(EXAMPLES / "llama-7b-estimate" / "pilot.yaml", check_files=False)
    row = {"gpus": 1, "price_per_gpu_hour": None, "seconds_per_update": 1.0, "utilisation_source": "catalog default",
           "cost_note": None}
    details = {"bytes": 10**9, "bytes_per_second": 1e9, "write_seconds": 1.0, "blocking_seconds": 0.1,
               "blocking_bytes_per_second": 1e10}
    with Ledger(tmp_path / "l.sqlite") as led:
        led.start_run("p", "job", "pilot", config_hash=spec.config_hash())
        led.add_gate_row("p", {"gate": "save", "verdict": "pass", "reason": "", "inputs": {}, "memory": {},
                               "seconds": 1.0, "details": details})
        items = {i["item"]: i for i in pipeline_hours(spec, row, synthetic_trace(), led)["items"]}
    trace = synthetic_trace()
    ckpt_bytes = trace["parameter_bytes"] + trace["optimizer_state_bytes"]
    assert items["checkpoints"]["hours"] == pytest.approx(10 * ckpt_bytes / 1e10 / 3600)
    assert "10000 MB/s (what the job waited in pilot p; written at 1000 MB/s behind it)" in items["checkpoints"]["from"]
    assert "at 1000 MB/s" in items["export"]["from"]


def test_the_next_background_save_reuses_the_host_buffers_once_the_last_is_written(tmp_path):
    from pilotrun.checkpoint import saving

    trainer = Tiny()
    first = start_checkpoint(tmp_path / "step-000001", trainer, {"c": 1})
    buffers = [b.data_ptr() for b in saving._STAGING.buffers]
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.model(torch.randn(3, 8)).sum().backward()
    trainer.optimizer.step()
    trainer.step = 2
    second = start_checkpoint(tmp_path / "step-000002", trainer, {"c": 1})
    assert first.done()  # the second copy waited for the first write: it copies into the same buffers
    assert [b.data_ptr() for b in saving._STAGING.buffers] == buffers
    first.wait()
    second.wait()
    saving.release_staging()
    assert saving._STAGING.buffers == []
    old, _ = _load_sharded(tmp_path / "step-000001", "model")
    new, _ = _load_sharded(tmp_path / "step-000002", "model")
    assert all(torch.equal(old[k], before[k]) for k in before)
    assert all(torch.equal(new[k], v) for k, v in trainer.model.state_dict().items())


TWO_RANK_ASYNC_DCP = textwrap.dedent("""
    import json, sys, torch
    import torch.distributed as dist
    from pathlib import Path
    from pilotrun import distributed, strategies
    from pilotrun.checkpoint import LoadPolicy, manifest_sha256
    from pilotrun.checkpoint.dist import restore_distributed, start_distributed

    rank, store, root = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    env = distributed.DistEnv(rank, rank, 2, "ddp")

    class Job:
        def __init__(self):
            torch.manual_seed(0)
            self.plain_model = torch.nn.Linear(4, 4)
            self.model = strategies.get("ddp").wrap(self.plain_model, env, torch.device("cpu"))[0]
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: 1.0)
            self.scaler, self.step = None, 1

        def update(self):
            self.model(torch.ones(2, 4)).sum().backward()
            self.optimizer.step()

        def state(self):
            return {"step": self.step, "examples_seen": 2, "data_position": {"epoch": 0, "micro_index": 1}}

        def load_state(self, state):
            self.step = state["step"]

    job = Job()
    job.update()
    saved = job.plain_model.weight.detach().clone()
    pending = start_distributed(root / "step-000001", job, {"c": 1}, env)
    job.update()  # the job goes on while DCP writes: the checkpoint keeps the weights of the save
    job.update()
    record = pending.wait()
    assert not torch.equal(job.plain_model.weight.detach(), saved)
    fresh = Job()
    LoadPolicy.of([manifest_sha256(root / "step-000001")]).admit(root / "step-000001")
    restore_distributed(fresh, root / "step-000001", env)
    print(json.dumps({"restored": torch.equal(fresh.plain_model.weight.detach(), saved), "files": len(record["files"]),
                      "behind": pending.behind}), flush=True)
    distributed.shutdown(env)
""")


@pytest.mark.process
def test_a_dcp_save_behind_the_job_keeps_the_state_of_its_start_on_every_rank(tmp_path):
    from tests.strategies.test_distributed import STALLED_S, _outputs_unless_stalled

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANK_ASYNC_DCP, str(rank), str(tmp_path / "store"),
                               str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in (0, 1)]
    outs = _outputs_unless_stalled(procs, STALLED_S)
    assert outs is not None, "a rank stalled in the background save"
    assert [p.returncode for p in procs] == [0, 0], outs
    for out, _ in outs:
        result = json.loads(out.strip().splitlines()[-1])
        assert result["restored"] and result["behind"] and result["files"] > 0, result
    assert set(verify_folder(tmp_path / "step-000001")["files"]) >= {"dcp/.metadata", "rng-rank0.pt", "rng-rank1.pt"}
