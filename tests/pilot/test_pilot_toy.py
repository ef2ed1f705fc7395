"""The pilot on a user's own factories (no transformers): rows, verdicts, skips and reasons."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from pilotrun.config import load_spec
from pilotrun.ledger import Ledger
from pilotrun.pilot import PilotOptions, run_pilot
from tests.conftest import SPEC_ORDER as GATES
from tests.conftest import TEST_DIGEST, copy_fixture, steady_verdicts

# Every gate but the three that start worker processes: those have their own tests.
IN_PROCESS = [g for g in GATES if g not in ("restore", "resume", "reload_eval")]


def run(spec_path, tmp_path, overrides=(), gates=IN_PROCESS):
    spec = load_spec(spec_path, list(overrides))
    opts = PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "ledger.sqlite", gates=gates)
    return run_pilot(spec, opts)


def by_gate(result):
    return {r["gate"]: r for r in result.rows}


@pytest.mark.process
def test_correct_setup_passes_every_gate(toy, tmp_path):
    result = run(toy, tmp_path, gates=None)
    rows = by_gate(result)
    assert list(rows) == GATES
    verdicts = steady_verdicts(rows)  # steady_step's data-wait warn depends on the machine; every other gate passes
    assert verdicts == {g: "pass" for g in GATES}, [r["reason"] for r in result.rows]
    assert result.exit_code == 0 and result.status in ("pass", "warn")
    for gate in GATES:
        mem = rows[gate]["memory"]
        assert rows[gate]["seconds"] > 0
        # Gates that only read data (lock, split, batch) may allocate no tensor at all: 0 is the measurement.
        # resume runs in three processes: it reports their host RSS and says why tensors are not summed.
        if gate == "resume":
            assert mem["host_rss_peak_bytes"] > 0 and "three processes" in mem["not_measured"]["peak_allocated_bytes"]
            continue
        assert mem["peak_allocated_bytes"] > 0 or gate in ("lock", "split", "batch"), gate
        assert mem["host_rss_peak_bytes"] > 0
        assert mem["peak_reserved_bytes"] is None and "no caching-allocator" in mem["not_measured"]["peak_reserved_bytes"]
    # AdamW state is allocated by the first update: it is live (and counted) from then on.
    assert rows["first_step"]["details"]["optimizer_state_bytes"] > 0
    assert rows["steady_step"]["memory"]["peak_allocated_bytes"] >= rows["first_step"]["memory"]["state_bytes_after"]["optimizer_state"]
    assert rows["first_step"]["inputs"]["examples_per_update"] == 8  # 4 x 2 accumulation
    assert rows["steady_step"]["details"]["seconds_per_update"] > 0
    assert len(rows["steady_step"]["details"]["timed_updates"]) == 2  # pilot.updates 4 = 1 first + 1 tracked + 2 timed
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [g["gate"] for g in report["gates"]] == GATES
    assert set(report["gates"][0]) >= {"gate", "verdict", "reason", "inputs", "memory", "seconds"}
    # The archive carries the factory's module: the model reloads without the spec folder or pilotrun.
    from pilotrun.report.archive import archive_run

    with Ledger(tmp_path / "ledger.sqlite") as led:
        path, summary = archive_run(led, result.run_id, tmp_path / "toy.tar.gz")
    assert summary["model"]
    with tarfile.open(path) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    root = tmp_path / "unpacked" / result.run_id
    assert (root / "code" / "toy.py").is_file() and (root / "model" / "export.json").is_file()
    shutil.rmtree(toy.parent)  # the user's folder is gone; the archive must not need it
    rerun = subprocess.run([sys.executable, "-I", str(root / "rerun_control.py")], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
    assert rerun.returncode == 0 and rerun.stdout.startswith("match:"), rerun.stdout + rerun.stderr


def test_rows_survive_in_the_ledger(toy, tmp_path):
    result = run(toy, tmp_path)
    with Ledger(tmp_path / "ledger.sqlite") as led:
        stored = led.gate_rows(result.run_id)
        assert [r["gate"] for r in stored] == IN_PROCESS
        # The run's status is its rows': every gate passes, except that on a machine busy with other processes the
        # steady step may measure the toy's data wait above the warning line (a timing, said as such, never a fail).
        warned = [(r["gate"], r["reason"]) for r in stored if r["verdict"] == "warn"]
        # (and the row notes a machine with more work than cores: procs.HostLoad.oversubscribed)
        assert all(g == "steady_step" and re.fullmatch(r"\d+% of update time is spent waiting on data: raise "
                                                       r"data\.num_workers or pre-tokenize, or the GPUs will idle"
                                                       r"(; timed on an oversubscribed machine .*)?", why)
                   for g, why in warned), warned
        assert all(r["verdict"] in ("pass", "warn") for r in stored), stored
        assert led.run(result.run_id)["status"] == ("warn" if warned else "pass")
        metrics = [m for m in led.metrics(result.run_id) if m["gate"] in ("first_step", "steady_step")]
        assert [m["step"] for m in metrics if m["gate"] in ("first_step", "steady_step")] == [1, 2, 3, 4]
        assert all(len(m["sample_ids"]) == 8 for m in metrics)
        assert all(m["loss"] is not None and m["lr"] > 0 for m in metrics)


def test_lock_reports_drift_field_by_field(toy, tmp_path):
    run(toy, tmp_path, gates=["lock"])
    same = by_gate(run(toy, tmp_path, gates=["lock"]))["lock"]
    assert same["verdict"] == "pass" and "no drift" in same["reason"]
    # A key the user varies on purpose is the experiment they changed: said, not warned about.
    changed = by_gate(run(toy, tmp_path, ["train.optimizer.lr=0.02"], gates=["lock"]))["lock"]
    assert changed["verdict"] == "pass", changed["reason"]
    assert "config changed from" in changed["reason"] and "train.optimizer.lr" in changed["reason"]
    kinds = {d["field"]: d["kind"] for d in changed["details"]["drift"]}
    assert kinds["config.train.optimizer.lr"] == "experiment" and kinds["config_hash"] == "experiment"
    assert changed["details"]["config_changes"][0]["key"] == "train.optimizer.lr"
    lock = json.loads((tmp_path / "out" / "lock.json").read_text())
    assert lock["versions"]["torch"] and "torch" in lock["distributions"]
    assert lock["model"]["source"] == "factory" and len(lock["model"]["source_sha256"]) == 64
    assert lock["container"]["digest"] == TEST_DIGEST


def test_inf_loss_fails_first_step_and_stops_dependents(toy, tmp_path):
    result = run(toy, tmp_path, ["model.bug=inf_loss"])
    rows = by_gate(result)
    assert rows["first_step"]["verdict"] == "fail"
    assert "loss is inf at update 1" in rows["first_step"]["reason"]
    assert "ex" in rows["first_step"]["reason"]  # names the example ids
    assert rows["steady_step"]["verdict"] == "skip" and rows["steady_step"]["reason"].startswith("skipped: first_step failed (")
    assert rows["save"]["verdict"] == "skip"
    # eval needs only load, so it runs, and meets the same broken loss; export is unaffected.
    assert rows["eval"]["verdict"] == "fail" and "eval loss is inf" in rows["eval"]["reason"]
    assert rows["export"]["verdict"] == "pass"
    assert result.exit_code == 1


def test_out_of_memory_names_stage_and_input(toy, tmp_path):
    rows = by_gate(run(toy, tmp_path, ["model.bug=eval_oom"], gates=["eval", "save"]))
    assert rows["eval"]["verdict"] == "fail"
    reason = rows["eval"]["reason"]
    assert reason.startswith("eval at length") and "batch 8" in reason
    # The accelerator's allocator ran out (the run measured the CPU): said so, with the allocator's own words.
    assert "out of accelerator memory" in reason and "CUDA out of memory. Tried to allocate 20.00 GiB" in reason
    assert rows["save"]["verdict"] == "pass"


def test_contract_violations_fail_load_with_the_contract(toy, tmp_path):
    rows = by_gate(run(toy, tmp_path, ["data.bug=not_a_mapping"]))
    # The data is first built by inspect: it fails, everything that needs data is skipped with the reason.
    assert rows["inspect"]["verdict"] == "fail"
    assert "returned list; expected a mapping with 'train', 'val' and 'collate'" in rows["inspect"]["reason"]
    assert all(rows[g]["verdict"] == "skip" for g in IN_PROCESS[2:])
    assert rows["load"]["reason"].startswith("skipped: the data could not be built in inspect (")
    # A gate skipped behind a skipped gate names the root cause, once.
    assert rows["steady_step"]["reason"].startswith("skipped: needs first_step, skipped because inspect failed (")
    rows = by_gate(run(toy, tmp_path, ["model.bug=not_a_module"]))
    assert rows["inspect"]["verdict"] == "pass"
    assert "expected a torch.nn.Module" in rows["load"]["reason"]
    rows = by_gate(run(toy, tmp_path, ["model.bug=no_loss"]))
    assert rows["first_step"]["verdict"] == "fail" and "without a loss" in rows["first_step"]["reason"]


def test_all_split_by_group(toy, tmp_path):
    rows = by_gate(run(toy, tmp_path, ["data.split=all", "data.val_fraction=0.25"], gates=["split", "load"]))
    assert rows["load"]["verdict"] == "pass"
    sizes = rows["load"]["details"]["data_sizes"]
    assert sizes["train"] + sizes["val"] == 96 and sizes["val"] > 0


def test_gate_selection_adds_prerequisites(toy, tmp_path):
    result = run(toy, tmp_path, gates=["save"])
    assert [r["gate"] for r in result.rows] == ["load", "first_step", "save"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cpu(toy, tmp_path, precision):
    rows = by_gate(run(toy, tmp_path, [f"train.precision={precision}"], gates=["steady_step", "eval"]))
    assert rows["steady_step"]["verdict"] in ("pass", "warn"), rows["steady_step"]["reason"]
    assert rows["first_step"]["inputs"]["precision"] == precision


def test_factory_gets_the_mapping_as_written(toy, tmp_path):
    # toy.build_model passes every key but "factory" to the constructor: an added default would break it.
    rows = by_gate(run(toy, tmp_path, gates=["load"]))
    assert rows["load"]["verdict"] == "pass"
    rows = by_gate(run(toy, tmp_path, ["model.bug=class_not_instance"], gates=["load"]))
    assert "returned the class BagClassifier, not an instance" in rows["load"]["reason"]


def test_sys_exit_in_a_factory_is_a_failed_gate(toy, tmp_path):
    result = run(toy, tmp_path, ["data.bug=exit"])
    rows = by_gate(result)
    assert rows["inspect"]["verdict"] == "fail" and "called sys.exit(0)" in rows["inspect"]["reason"]
    assert "toy.py" in rows["inspect"]["reason"] and result.exit_code == 1


def test_collate_without_labels_or_supervision_fails_first_step(toy, tmp_path):
    rows = by_gate(run(toy, tmp_path, ["data.bug=label_key"]))
    assert rows["first_step"]["verdict"] == "fail"
    assert "returned no 'labels' (got ['attention_mask', 'input_ids', 'label'])" in rows["first_step"]["reason"]
    rows = by_gate(run(toy, tmp_path, ["data.bug=all_masked"]))
    assert rows["first_step"]["verdict"] == "fail"
    assert "no supervised labels" in rows["first_step"]["reason"]


def test_an_update_that_teaches_nothing_is_refused_before_the_step(toy, tmp_path):
    mod = toy.parent / "toy.py"
    mod.write_text(mod.read_text().replace(
        '            if self.bug != "no_loss":',
        '            if self.bug == "constant_loss":\n'
        '                loss = torch.tensor(2.0, requires_grad=True)\n'
        '            if self.bug != "no_loss":'))
    rows = by_gate(run(toy, tmp_path, ["model.bug=constant_loss"]))
    assert rows["first_step"]["verdict"] == "fail"
    assert "no trainable parameter received a gradient in update 1" in rows["first_step"]["reason"]
    assert "the model as loaded (no update succeeded)" in rows["export"]["reason"]  # the refused update was not applied


@pytest.mark.process
def test_json_stdout_stays_clean_when_user_code_prints(tmp_path):
    from tests.conftest import pilotrun_cli

    spec = copy_fixture("toy", tmp_path)
    mod = spec.parent / "toy.py"
    mod.write_text(mod.read_text().replace("def build_data(cfg):\n", "def build_data(cfg):\n    print('loading data ...')\n"))
    res = pilotrun_cli("run", str(spec), "--gates", "load", "--json", "--ledger", str(tmp_path / "l.sqlite"),
                       "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["gates"]
    assert "loading data ..." in res.stderr


@pytest.mark.process
def test_a_plain_pytorch_pilot_never_imports_transformers(tmp_path):
    # It once imported transformers only to quiet its logs: ~1.5 s of CPU in every process of a job that never
    # used it, and an import error from a broken transformers install would have failed a job that has no need of it.
    spec = copy_fixture("toy", tmp_path)
    code = ("import sys\nfrom pilotrun.config import load_spec\nfrom pilotrun.pilot import PilotOptions, run_pilot\n"
            f"r = run_pilot(load_spec({str(spec)!r}), PilotOptions(out_dir={str(tmp_path / 'o')!r}, "
            f"ledger_path={str(tmp_path / 'l.sqlite')!r}, gates=['load', 'first_step', 'steady_step', 'save']))\n"
            "print([row['verdict'] for row in r.rows], sorted(m for m in ('transformers', 'lightning') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    verdicts, imported = out.stdout.strip().splitlines()[-1].split("] ")
    assert "fail" not in verdicts and verdicts.count("'") == 8, out.stdout  # four gates ran, none failed
    assert imported == "[]", out.stdout
