"""An accelerate loop piloted as it is (issue 20, 4): examples/accelerate/ launched with `accelerate launch`, its probe
gates from ``pilotrun.integrations.accelerate.begin`` and its resume proven at its own save_state checkpoint; and the
defects people plant in such loops, each caught by the resume gate with its cause."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pilotrun.config.load import load_spec
from pilotrun.pilot import PilotOptions, run_pilot
from pilotrun.program.runner import command_words
from tests.conftest import TEST_DIGEST, pilotrun_cli, planted_example, require, write_spec

require("accelerate", "accelerate")


def _copy(tmp_path: Path, patches: dict[str, str] | None = None) -> Path:
    folder = planted_example("accelerate", tmp_path / "accelerate", patches)
    if patches:  # the defects are the loop's own: run it without the launcher process (one interpreter fewer per run)
        spec = folder / "pilot.yaml"
        spec.write_text(spec.read_text().replace(
            "accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no train.py",
            "python train.py"))
        assert "python train.py --updates" in spec.read_text()
    return folder / "pilot.yaml"


def _rows(spec: Path, tmp_path: Path, gates=None) -> dict:
    result = run_pilot(load_spec(spec, allow_program=True),
                       PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "l.sqlite", gates=gates,
                                    container_digest=TEST_DIGEST))
    return {r["gate"]: r for r in result.rows}


def test_accelerate_launch_runs_with_pilotruns_interpreter():
    import sys

    assert command_words(["accelerate", "launch", "--num_processes", "1", "train.py"]) == [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "train.py"]
    assert command_words(["accelerate", "env"]) == ["accelerate", "env"]  # only launch is a launcher


@pytest.mark.process
def test_the_accelerate_example_passes_every_gate_it_can_run(tmp_path):
    rows = _rows(_copy(tmp_path), tmp_path)
    verdicts = {g: r["verdict"] for g, r in rows.items()}
    assert verdicts == {"lock": "pass", "inspect": "pass", "split": "skip", "batch": "pass", "load": "skip",
                        "first_step": "pass", "steady_step": "pass", "accum_equivalence": "pass", "eval": "pass",
                        "save": "pass", "export": "pass", "restore": "skip", "resume": "pass", "overfit": "pass",
                        "reload_eval": "pass"}, {g: (r["verdict"], r["reason"][:160]) for g, r in rows.items()}
    assert "proven at the program's own checkpoint after update 8" in rows["resume"]["reason"]
    assert "bitwise" in rows["resume"]["reason"]
    assert "4 x 2 x 1 replica(s) = 8 examples per update" in rows["batch"]["reason"]
    assert "GPT2LMHeadModel (transformers from_pretrained)" in rows["reload_eval"]["reason"]
    # The same spec answers which GPU: the job comes from the objects the loop prepared.
    res = pilotrun_cli("estimate", str(tmp_path / "accelerate" / "pilot.yaml"), "--accelerator", "H100-80GB",
                       "--gpus", "2", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    ours = json.loads(res.stdout)
    values = {v["key"]: v for v in ours["program"]["values"]}
    assert values["train.grad_accum_steps"]["value"] == 2 and values["train.micro_batch_size"]["value"] == 4
    assert values["data.max_length"]["value"] == 16 and values["train.updates"]["value"] == 24
    assert values["train.optimizer.lr"]["value"] == 3e-3 and values["train.precision"]["source"] == "program"
    # A pilotrun spec written by hand from train.py gives the same numbers (issue 20: within 2%).
    hand = write_spec(tmp_path / "by-hand.yaml", {
        "name": "accelerate-by-hand",
        "model": {"config": {"model_type": "gpt2", "vocab_size": 32, "n_positions": 16, "n_embd": 32, "n_layer": 2,
                             "n_head": 2}},
        "data": {"task": "causal-lm", "max_length": 16},
        "train": {"micro_batch_size": 4, "grad_accum_steps": 2, "updates": 24, "max_grad_norm": 1.0,
                  "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01, "fused": False}}})
    res = pilotrun_cli("estimate", str(hand), "--accelerator", "H100-80GB", "--gpus", "2", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    theirs = json.loads(res.stdout)
    assert ours["model"]["parameters"] == theirs["model"]["parameters"]
    for mine, by_hand in zip(ours["fits"], theirs["fits"], strict=True):
        for key in ("device_used_bytes", "peak_allocated_bytes", "seconds_per_update"):
            assert mine[key] == pytest.approx(by_hand[key], rel=0.02), (mine["strategy"], key)


PLANTED = {
    # The scheduler stepped by hand and never given to prepare(): save_state does not save it.
    "scheduler": ({"model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)":
                   "model, opt, loader = accelerator.prepare(model, opt, loader)",
                   "                    sched.step()\n": "                    if accelerator.sync_gradients:\n"
                                                         "                        sched.step()\n"},
                  "lr", "scheduler"),
    # The resumed epoch starts from its first batch again.
    "not skipped": ({"accelerator.skip_first_batches(loader, done * ACCUM) if done else loader": "loader"},
                    "ids", "data order"),
    # The documented recipe's loader: iter() draws its base seed from torch's global RNG after load_state restored
    # it, so every dropout mask after the resume is shifted.
    "dropout shifted": ({", collate_fn=collate,\n                                     generator=torch.Generator()"
                         ".manual_seed(args.seed))": ", collate_fn=collate)"},
                        "loss", "RNG"),
}


@pytest.mark.process
@pytest.mark.parametrize("defect", sorted(PLANTED))
def test_each_planted_defect_fails_the_resume_gate_with_its_cause(tmp_path, defect):
    patches, field, cause = PLANTED[defect]
    rows = _rows(_copy(tmp_path, patches), tmp_path, gates=["resume"])
    row = rows["resume"]
    assert row["verdict"] == "fail", row["reason"]
    assert field in row["reason"] and cause in row["reason"], row["reason"]
