"""Checkpoints are atomic and verifiable: a real SIGKILL mid-save never damages the last good one."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from pilotrun.checkpoint import AtomicFolder, CheckpointError, latest_checkpoint, verify_folder

SLOW_SAVER = textwrap.dedent("""
    import sys, torch
    from pilotrun.checkpoint import AtomicFolder
    with AtomicFolder(sys.argv[1], "checkpoint", {"step": 2}) as f:
        f.write_json("trainer_state.json", {"step": 2})
        for i in range(200):
            f.write_with(f"shard{i}.pt", torch.save, {"w": torch.randn(1 << 20)})
""")


def good_checkpoint(folder, step=1):
    with AtomicFolder(folder, "checkpoint", {"step": step}) as f:
        f.write_with("model.pt", torch.save, {"w": torch.arange(10.0)})
        f.write_json("trainer_state.json", {"step": step})
    return f


def test_manifest_records_every_file(tmp_path):
    f = good_checkpoint(tmp_path / "step-000001")
    manifest = verify_folder(tmp_path / "step-000001")
    assert set(manifest["files"]) == {"model.pt", "trainer_state.json"}
    assert manifest["format"] == "pilotrun-checkpoint/1" and manifest["step"] == 1
    assert f.total_bytes == sum(p.stat().st_size for p in (tmp_path / "step-000001").iterdir() if p.name != "manifest.json")
    state = torch.load(tmp_path / "step-000001" / "model.pt", weights_only=True)
    assert torch.equal(state["w"], torch.arange(10.0))


@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_bytes(p.read_bytes()[:-7]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + b"X"), "does not match its sha256"),
    (lambda p: p.unlink(), "missing"),
])
def test_damage_is_named(tmp_path, damage, words):
    good_checkpoint(tmp_path / "step-000001")
    damage(tmp_path / "step-000001" / "model.pt")
    with pytest.raises(CheckpointError, match=words):
        verify_folder(tmp_path / "step-000001")


def test_failed_write_leaves_no_folder(tmp_path):
    with pytest.raises(RuntimeError):
        with AtomicFolder(tmp_path / "step-000002", "checkpoint") as f:
            f.write_json("a.json", {})
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.process
def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path):
    good_checkpoint(tmp_path / "step-000001")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVER, str(tmp_path / "step-000002")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    tmp_dirs = []
    while time.time() < deadline and not tmp_dirs:
        tmp_dirs = [p for p in tmp_path.glob(".step-000002.tmp-*") if any(p.glob("shard*.pt"))]
        time.sleep(0.01)
    assert tmp_dirs, "the saver never started writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "step-000002").exists()  # the half-written one never took the name
    assert tmp_dirs[0].exists()  # ... it is left as .tmp- and ignored
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    verify_folder(tmp_path / "step-000001")
    assert json.loads((tmp_path / "step-000001" / "trainer_state.json").read_text())["step"] == 1


def test_replacing_a_folder_and_recovering_an_interrupted_swap(tmp_path):
    good_checkpoint(tmp_path / "step-000003", step=3)
    good_checkpoint(tmp_path / "step-000003", step=30)  # replaced atomically
    assert verify_folder(tmp_path / "step-000003")["step"] == 30
    # A kill between the two renames of a replace leaves only .step-000003.old-PID:
    (tmp_path / "step-000003").rename(tmp_path / ".step-000003.old-123")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000003"


class _TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 16, bias=False)
        self.head.weight = self.embed.weight  # tied, as tie_word_embeddings does


def test_gathered_weights_are_retied_so_the_export_equals_one_process(tmp_path):
    from safetensors import safe_open

    from pilotrun.checkpoint import export_model
    from pilotrun.checkpoint.dist import retie, tied_names

    torch.manual_seed(0)
    model = _TiedLM()
    assert tied_names(model) == [["embed.weight", "head.weight"]]
    # What a full-state-dict gather returns: one separate CPU copy per name, the tie lost.
    gathered = {k: v.detach().clone() for k, v in model.state_dict().items()}
    export_model(tmp_path / "one", model)
    export_model(tmp_path / "untied", model, state_dict=gathered)
    export_model(tmp_path / "retied", model, state_dict=retie(gathered, tied_names(model)))

    def names(folder):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
            return sorted(fh.keys())

    assert names(tmp_path / "one") == ["body.bias", "body.weight", "embed.weight"]
    assert names(tmp_path / "untied") == [*names(tmp_path / "one"), "head.weight"]  # what the FSDP export did
    assert (tmp_path / "retied" / "model.safetensors").read_bytes() == \
        (tmp_path / "one" / "model.safetensors").read_bytes()
