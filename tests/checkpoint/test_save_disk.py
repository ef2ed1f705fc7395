"""A save on a full disk is a failed row with its reason and traceback; temp folders of killed saves are
removed at the next save (issue 12, deliverable 4).

A real full filesystem needs root (a tmpfs mount), so the full disk is injected at the one place every
checkpoint byte goes through: the write raises OSError(ENOSPC) exactly as write(2) reports it.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pilotrun.checkpoint import io as ckpt_io
from pilotrun.config import load_spec
from pilotrun.ledger.store import Ledger
from pilotrun.pilot import PilotOptions, run_pilot


def _pilot(spec_path, tmp_path, gates):
    spec = load_spec(spec_path)
    return run_pilot(spec, PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "l.sqlite", gates=gates))


def test_a_full_disk_fails_the_save_row_with_the_path_and_a_traceback(toylm, tmp_path, monkeypatch):
    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt_io.HashingWriter, "write", full)
    result = _pilot(toylm, tmp_path, ["save"])
    rows = {r["gate"]: r for r in result.rows}
    save = rows["save"]
    folder = tmp_path / "out" / "checkpoints"
    assert save["verdict"] == "fail" and save["details"]["failure"] == "error"
    assert "No space left on device" in save["reason"] and str(folder) in save["reason"]
    assert save["details"]["errno"] == errno.ENOSPC and save["details"]["free_bytes"] > 0
    tb = tmp_path / "out" / "save.traceback.txt"
    assert "No space left on device" in tb.read_text()
    # The row reached the ledger and the run ended as a failed gate, not as a pilotrun error.
    with Ledger(tmp_path / "l.sqlite") as led:
        stored = {r["gate"]: r for r in led.gate_rows(result.run_id)}
        assert stored["save"]["verdict"] == "fail"
        assert led.run(result.run_id)["status"] == "fail"
    # The failed save left no temp folder behind.
    assert not [p.name for p in folder.iterdir() if ".tmp-" in p.name]


def test_a_traceback_that_cannot_be_written_is_kept_in_the_row(toylm, tmp_path, monkeypatch):
    from pilotrun.pilot import runner

    monkeypatch.setattr(ckpt_io.HashingWriter, "write",
                        lambda self, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    real_write_text = runner.Path.write_text

    def refuse_tracebacks(self, *a, **k):
        if self.name.endswith(".traceback.txt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write_text(self, *a, **k)

    monkeypatch.setattr(runner.Path, "write_text", refuse_tracebacks)
    result = _pilot(toylm, tmp_path, ["save"])
    save = {r["gate"]: r for r in result.rows}["save"]
    assert save["verdict"] == "fail"
    assert "No space left on device" in save["details"]["traceback_not_written"]
    assert "Traceback" in save["details"]["traceback_tail"]
    assert not (tmp_path / "out" / "save.traceback.txt").exists()


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


@pytest.mark.process
def test_a_save_killed_mid_write_leaves_a_temp_folder_that_is_removed_and_counted(tmp_path):
    root = tmp_path / "checkpoints"
    script = ("import sys, time; from pathlib import Path; from pilotrun.checkpoint.io import AtomicFolder\n"
              f"f = AtomicFolder(Path({str(root / 'step-000004')!r}), 'checkpoint').__enter__()\n"
              "f.write_bytes('model.pt', b'x' * (3 << 20)); print('written', flush=True); time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout.readline().strip() == "written"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    killed = root / f".step-000004.tmp-{proc.pid}"
    assert killed.is_dir()
    alive = root / f".step-000006.tmp-{os.getppid()}"   # a live writer's folder is never touched
    alive.mkdir()
    removed = ckpt_io.remove_stale_temps(root)
    assert removed == [(killed, 3 << 20)]
    assert not killed.exists() and alive.exists()


@pytest.mark.process
def test_the_next_save_removes_stale_temps_and_says_how_much_it_freed(toylm, tmp_path):
    stale = tmp_path / "out" / "checkpoints" / f".step-000002.tmp-{_dead_pid()}"
    stale.mkdir(parents=True)
    (stale / "model-00000-of-00001.pt").write_bytes(b"\0" * (2 << 20))
    result = _pilot(toylm, tmp_path, ["save"])
    save = {r["gate"]: r for r in result.rows}["save"]
    assert save["verdict"] == "pass", save["reason"]
    assert not stale.exists()
    assert save["details"]["stale_temps_removed"] == [{"path": str(stale), "bytes": 2 << 20}]
    assert "removed 1 temp folder(s) of saves whose process is gone, freeing 2.0 MiB" in save["reason"]


def test_a_full_disk_under_torch_save_is_said_as_the_os_says_it():
    # Found filling a disk: torch.save given a path writes in C++ and loses the OS error ("unexpected pos 768 vs
    # 662"). /dev/full refuses every write with ENOSPC, for real.
    import errno

    from pilotrun.checkpoint.io import disk_full_error
    from pilotrun.checkpoint.state import save_to
    from pilotrun.gates.save import write_failure

    with pytest.raises(Exception) as info:
        save_to({"entries": {"w": torch.zeros(4096)}}, Path("/dev/full"))
    full = disk_full_error(info.value)
    assert full is not None and full.errno == errno.ENOSPC, repr(info.value)
    failure = write_failure(Path("/tmp/ckpt/step-000002"), info.value, {})
    assert "No space left on device" in str(failure) and "free on its filesystem now" in str(failure), str(failure)
