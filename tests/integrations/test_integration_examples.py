"""The framework examples (a transformers Trainer, Lightning, TRL's SFTTrainer) piloted end to end by ``pilotrun run``: the program runner starts them as real
subprocesses (control, interrupted — SIGKILLed after its save — and resumed), and the callbacks' in-process gates
come back through the handle's event files. Every gate that can run on them passes; the rest say why."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, TEST_DIGEST, pilotrun_cli

pytestmark = pytest.mark.process

# Gates a program cannot have (README, "Pilot your own program"): skip with the reason, never a silent pass.
NOT_ON_A_PROGRAM = {"split", "restore"}
INTEGRATION_GATES = ["inspect", "batch", "accum_equivalence", "overfit", "export", "reload_eval"]


def pilot(example: str, tmp_path: Path, *extra: str, spec: str = "pilot.yaml") -> tuple[int, dict]:
    folder = tmp_path / example
    shutil.copytree(EXAMPLES / example, folder, ignore=shutil.ignore_patterns("runs", "out", "__pycache__"))
    out = pilotrun_cli("run", spec, "--json", "--container-digest", TEST_DIGEST, *extra, cwd=folder, timeout=900)
    assert out.stdout.strip(), out.stderr[-3000:]
    return out.returncode, {g["gate"]: g for g in json.loads(out.stdout)["gates"]}


@pytest.mark.parametrize(("example", "spec"), [("hf-trainer", "pilot.yaml"), ("lightning", "pilot.yaml"),
                                              ("trl-sft", "pilot.yaml"), ("trl-sft", "dpo.yaml")])
def test_framework_example_passes_every_gate_it_can_run(tmp_path, example, spec):
    code, gates = pilot(example, tmp_path, spec=spec)
    problems = {name: (g["verdict"], g["reason"][:300]) for name, g in gates.items()
                if g["verdict"] not in ("pass", "skip") and not (name == "lock" and g["verdict"] == "warn")}
    assert code == 0 and not problems, problems
    for name in INTEGRATION_GATES + ["load", "first_step", "steady_step", "eval", "save", "resume"]:
        assert gates[name]["verdict"] == "pass", (name, gates[name]["reason"])
    for name in NOT_ON_A_PROGRAM:
        assert gates[name]["verdict"] == "skip" and gates[name]["reason"], name
    assert "SIGKILL" in gates["resume"]["reason"]
    if spec == "dpo.yaml":  # a preference trainer: its overfit is judged on the pairs ranked right
        assert "of the pairs ranked right" in gates["overfit"]["reason"], gates["overfit"]["reason"]
    if example == "trl-sft":
        # TRL's SFTTrainer on a datasets.Dataset: the Trainer drops the id column before any collator, so the
        # callback compares the examples' dataset positions (the sampler's indices) and the row says so.
        assert "dataset positions" in gates["resume"]["reason"]
        assert "own checkpoint after update" in gates["resume"]["reason"]


@pytest.mark.parametrize("example", ["hf-trainer", "lightning"])
def test_framework_example_under_torchrun_with_two_processes(tmp_path, example):
    """The callbacks with two gloo processes (issue 20, 5): a row per rank for the stages and the resume proof (each
    rank's updates compared), the probes on rank 0 alone, and nothing left running (the leak check)."""
    folder = tmp_path / example
    shutil.copytree(EXAMPLES / example, folder, ignore=shutil.ignore_patterns("runs", "out", "__pycache__"))
    spec = folder / "pilot.yaml"
    spec.write_text(spec.read_text().replace("command: python train.py",
                                             "command: torchrun --standalone --nproc-per-node 2 train.py"))
    out = pilotrun_cli("run", "pilot.yaml", "--json", "--container-digest", TEST_DIGEST, cwd=folder, timeout=900)
    assert out.stdout.strip(), out.stderr[-3000:]
    rows = json.loads(out.stdout)["gates"]
    assert out.returncode == 0, [(r["gate"], r["verdict"], r["reason"][:200]) for r in rows]
    by_rank = {(r["gate"], r.get("rank", 0)): r for r in rows}
    for gate in ("first_step", "steady_step", "eval", "save", "resume"):
        assert {by_rank[(gate, rank)]["verdict"] for rank in (0, 1)} == {"pass"}, gate
        assert by_rank[(gate, 1)]["world_size"] == 2
    assert "bitwise" in by_rank[("resume", 1)]["reason"]
    probes = [r for r in rows if r["gate"] in INTEGRATION_GATES]
    assert sorted(r["gate"] for r in probes) == sorted(INTEGRATION_GATES)  # once each: rank 0's
    assert "x 2 replica(s)" in by_rank[("batch", 0)]["reason"]
    expected = {"export": "pass", "reload_eval": "pass"} if example == "hf-trainer" else {
        # Lightning's save_checkpoint is a collective the probe on rank 0 alone cannot join: said, not hung.
        "export": "skip", "reload_eval": "skip"}
    assert {g: by_rank[(g, 0)]["verdict"] for g in expected} == expected


PLANTED = '''
import transformers
import torch


class IgnoresNumItems(transformers.GPT2LMHeadModel):
    """Accepts num_items_in_batch and ignores it: each micro batch's own token mean (transformers#37766)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        kwargs.pop("num_items_in_batch", None)
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        logits = out.logits[:, :-1].flatten(0, 1)
        out.loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)
        return out
'''


def test_a_trainer_whose_model_ignores_num_items_in_batch_is_caught_by_accum_equivalence(tmp_path):
    folder = tmp_path / "hf-trainer"
    shutil.copytree(EXAMPLES / "hf-trainer", folder, ignore=shutil.ignore_patterns("runs", "out", "__pycache__"))
    (folder / "planted.py").write_text(PLANTED)
    script = (folder / "train.py").read_text()
    assert "model = chat.model(seed=opts.seed)" in script
    (folder / "train.py").write_text(script.replace("model = chat.model(seed=opts.seed)", "import planted\n    model = "
                                                    "chat.model(seed=opts.seed, model_class=planted.IgnoresNumItems)"))
    out = pilotrun_cli("run", "pilot.yaml", "--json", "--gates", "accum_equivalence", "--container-digest", TEST_DIGEST,
                       cwd=folder, timeout=900)
    gates = {g["gate"]: g for g in json.loads(out.stdout)["gates"]}
    assert out.returncode == 1, out.stderr[-2000:]
    row = gates["accum_equivalence"]
    assert row["verdict"] == "fail" and "#37766" in row["reason"], row["reason"]
    assert row["details"]["relative_grad_difference"] > 1e-3
