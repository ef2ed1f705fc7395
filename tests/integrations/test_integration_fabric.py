"""A Lightning Fabric loop piloted as it is (issue 44, 7): examples/fabric-loop/ run by ``pilotrun run``, its probe
gates from ``pilotrun.integrations.fabric.begin``; the job it describes from the objects Fabric set up; and the skip
reason of a loop without the integration naming the one that fits the framework the program uses."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pilotrun.config.load import load_spec
from pilotrun.config.program import ProgramSpec, program_file_problems
from pilotrun.drivers import ProgramDriver, RunSite, build_driver, join_job
from pilotrun.gates.registry import BY_NAME, GATE_NAMES
from pilotrun.gates.view import Artifact, NotMeasured
from pilotrun.ledger.records import Verdict
from pilotrun.program.describe import Framework, program_frameworks
from pilotrun.program.env import Role
from pilotrun.program.runner import RunOutcome, command_words
from tests.conftest import EXAMPLES, TEST_DIGEST, pilotrun_cli, planted_example, require, write_spec

require("lightning.fabric", "lightning")
from lightning.fabric import Fabric  # noqa: E402

from pilotrun.integrations.fabric import FabricView, begin, describe_loop  # noqa: E402

PROBES = ("inspect", "batch", "accum_equivalence", "overfit", "export", "reload_eval")


@pytest.fixture(scope="module")
def piloted(tmp_path_factory) -> dict:
    """One pilot of the example's probe gates (and what they need): one recording run of train.py."""
    work = tmp_path_factory.mktemp("fabric")
    folder = planted_example("fabric-loop", work / "fabric-loop")
    res = pilotrun_cli("run", str(folder / "pilot.yaml"), "--gates", ",".join(PROBES), "--out", str(work / "out"),
                       "--ledger", str(work / "l.sqlite"), "--container-digest", TEST_DIGEST, cwd=work, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((work / "out" / "report.json").read_text())
    return {row["gate"]: row for row in report["gates"]}


@pytest.mark.process
def test_the_fabric_example_passes_every_probe_gate_a_trainer_user_gets(piloted):
    verdicts = {g: piloted[g]["verdict"] for g in PROBES}
    assert verdicts == dict.fromkeys(PROBES, "pass"), {g: piloted[g]["reason"][:200] for g in PROBES}
    # Both rows come from the steps the loop really took (issue 44): its windows and its own division by 2.
    assert "observed over 3 optimizer step(s) (2/2/2 micro batches)" in piloted["batch"]["reason"]
    assert "4 x 2 x 1 replica(s) = 8 examples per update" in piloted["batch"]["reason"]
    assert ("the loop's first update as it ran: 2 micro batch(es) before its first optimizer step, each loss "
            "multiplied by the loop's factor (0.5, 0.5)") in piloted["accum_equivalence"]["reason"]
    assert "4 examples learned in" in piloted["overfit"]["reason"]


@pytest.mark.process
def test_the_export_is_the_models_own_and_reloads_in_a_fresh_process(piloted):
    export, reload = piloted["export"], piloted["reload_eval"]
    assert "written by save_pretrained" in export["reason"]
    assert Path(export["details"]["path"]).name == "pilotrun-export"
    assert "model.safetensors" in export["details"]["files"]
    # pilotrun's own check of the folder gave the digest the row keeps (never the program's word alone).
    assert export["details"]["manifest_sha256"] == export["details"]["reported_manifest_sha256"]
    assert "GPT2LMHeadModel (transformers from_pretrained) reloaded" in reload["reason"]
    assert "max difference 0" in reload["reason"]


def test_fabric_run_is_launched_with_pilotruns_interpreter(tmp_path):
    assert command_words(["fabric", "run", "--devices", "2", "train.py", "--updates", "6"]) == [
        sys.executable, "-m", "lightning.fabric.cli", "--devices", "2", "train.py", "--updates", "6"]
    assert command_words(["fabric", "consolidate", "ckpt"]) == ["fabric", "consolidate", "ckpt"]  # only run launches
    problems = program_file_problems(ProgramSpec(command="fabric run --devices 2 nosuch.py"), tmp_path)
    assert problems == [("program.command", f"nosuch.py not found in {tmp_path} (the command runs from the spec's "
                         "folder)")]


# ------------------------------------------------------------------------------ in this process: no program run


def _loop(model: torch.nn.Module, accumulate: int = 2):
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    items = [{"input_ids": list(range(i % 5 + 2)), "labels": list(range(i % 5 + 2))} for i in range(12)]

    def collate(batch):
        width = max(len(it["input_ids"]) for it in batch)
        return {"input_ids": torch.tensor([it["input_ids"] + [0] * (width - len(it["input_ids"])) for it in batch])}

    loader: torch.utils.data.DataLoader = torch.utils.data.DataLoader(items, batch_size=3,  # type: ignore[arg-type]
                                                                      collate_fn=collate)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, opt = fabric.setup(model, opt)
    return fabric, wrapped, opt, fabric.setup_dataloaders(loader)


class Job:
    """A handle as the integration reads it (role, rank, active)."""

    def __init__(self, role: str, active: bool = True) -> None:
        self.role, self.rank, self.active = role, 0, active
        self.described: Any = None

    def describe(self, facts) -> None:
        self.described = facts()


def test_the_job_is_described_from_the_objects_fabric_set_up():
    fabric, model, opt, loader = _loop(torch.nn.Linear(4, 4))
    facts = describe_loop(fabric, model, opt, loader, accumulate=2, updates=30, max_grad_norm=1.0)
    assert facts.framework == "lightning.Fabric" and facts.model_class == "torch.nn.modules.linear.Linear"
    assert (facts.micro_batch_size, facts.grad_accum_steps, facts.updates, facts.world_size) == (3, 2, 30, 1)
    assert (facts.precision, facts.precision_source) == ("bf16", "Fabric(precision='bf16-mixed')")
    assert facts.max_length == 6 and facts.optimizer is not None and facts.optimizer["name"] == "sgd"
    job = Job("describe")
    assert begin(job, fabric, model, opt, loader, accumulate=2) == {} and job.described.grad_accum_steps == 2
    assert begin(Job("control", active=False), fabric, model, opt, loader) == {}  # outside a pilot: nothing
    with pytest.raises(ValueError, match=r"begin\(accumulate=...\)"):
        begin(Job("control"), fabric, model, opt, loader, accumulate=0)


def test_a_plain_module_is_exported_as_safetensors_and_its_reload_says_why_not(tmp_path):
    fabric, model, _, loader = _loop(torch.nn.Linear(4, 4))
    view = FabricView(fabric, model, loader, loss=lambda m, b: m(b["input_ids"].float()[:, :4]).sum(), accumulate=2)
    assert view.model is model.module and view.batching().grad_accum_steps == 2
    assert view.batching().micro_batches_per_epoch == 4
    written = view.export(tmp_path / "export")
    assert written.weights == ["model.safetensors"] and written.tensors == 2
    problem = view.reload_problem(Artifact(tmp_path / "export", written.manifest_sha256))
    assert problem is not None and "Linear is not a transformers PreTrainedModel" in problem
    view.fabric = type("Two", (), {"world_size": 2})()  # several processes: a collective the probe cannot join
    with pytest.raises(NotMeasured, match="one process"):
        view.export(tmp_path / "export2")


# ------------------------------------------------------------------ the skip reason names the integration that fits


def test_each_example_is_read_as_the_framework_its_loop_uses(tmp_path):
    def frameworks(name: str) -> list[Framework]:
        return program_frameworks(sorted((EXAMPLES / name).glob("*.py")))

    assert frameworks("fabric-loop") == [Framework.FABRIC]
    assert frameworks("accelerate") == [Framework.ACCELERATE]
    assert frameworks("lightning") == [Framework.LIGHTNING]
    assert frameworks("hf-trainer") == [Framework.TRANSFORMERS]
    assert frameworks("own-loop") == []
    (tmp_path / "a.py").write_text("import lightning as L\nfabric = L.Fabric(devices=1)\n")
    (tmp_path / "b.py").write_text("import lightning as L\ntrainer = L.Trainer(max_steps=3)\n")
    (tmp_path / "c.py").write_text("def broken(:\n")  # read, never run: a file that does not parse adds nothing
    assert program_frameworks([tmp_path / "a.py", tmp_path / "c.py"]) == [Framework.FABRIC]
    assert program_frameworks([tmp_path / "b.py"]) == [Framework.LIGHTNING]


def _skip_reason(tmp_path: Path, script: str) -> str:
    (tmp_path / "train.py").write_text(script)
    spec = load_spec(write_spec(tmp_path / "pilot.yaml", {"name": "bare", "program": {"command": "python train.py"}}),
                     allow_program=True)
    driver = build_driver(spec, None, join_job(spec), site=RunSite("r1", tmp_path / "out", tmp_path / "l.sqlite"))
    assert isinstance(driver, ProgramDriver)
    driver.prepare([BY_NAME["batch"]], GATE_NAMES)
    driver.runs[Role.STAGES] = RunOutcome(Role.STAGES, 0, 1.0, tmp_path / "stages.log", events={0: []})
    rows = driver.proven_rows(BY_NAME["batch"])
    assert rows is not None
    (row,) = rows
    assert row.verdict == Verdict.SKIP
    return row.reason


def test_a_fabric_loop_without_the_integration_is_told_the_fabric_one(tmp_path):
    reason = _skip_reason(tmp_path, "from lightning.fabric import Fabric\nfabric = Fabric()\n")
    assert "the program uses Lightning Fabric: add pilotrun.integrations.fabric.begin(" in reason
    assert "Trainer" not in reason and "accelerate" not in reason


def test_a_loop_of_no_framework_is_told_every_integration(tmp_path):
    reason = _skip_reason(tmp_path, "import torch\nprint(torch.ones(1))\n")
    assert "the transformers or Lightning Trainer callback, begin() in an accelerate or Lightning Fabric loop" in reason
