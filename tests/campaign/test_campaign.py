"""Campaigns: declared up front, every run kept with its reason, retries linked, an honest conclusion.

The pure parts (the conclusion, the campaign file's checks) are unit tests; one real campaign of
three learning rates x two seeds on the demo model runs once for the module (worker processes,
two at a time, one shared SQLite ledger) and the rest reads what it left.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tarfile
from html import escape as html_escape
from pathlib import Path

import psutil
import pytest
import yaml

from pilotrun.campaign.conclude import conclude, unanswered_failures
from pilotrun.campaign.orchestrate import CampaignError, prepare
from pilotrun.campaign.spec import load_campaign
from pilotrun.checkpoint import LoadPolicy
from pilotrun.config.schema import SpecError
from pilotrun.ledger import Ledger
from tests.conftest import (
    FIXTURES,
    TEST_DIGEST,
    copy_example,
    ledger_rows,
    open_in_chromium,
    pilotrun_cli,
    polled_rows,
    require,
)

LRS = [3.0e-3, 1.0e-3, 1.0]  # control, a plausible variant, one that diverges
# At lr 1.0 the loss jumps around; whether it passes 3x its first within 12 updates depends on the CPU's arithmetic
# (seed 1 peaked at 2.3x on one 2-core VM and passed 3x on another), while every lr-1.0 trajectory seen passes 1.5x
# within 5 updates and the two smaller lrs only fall: the fixture's rule is 1.5x so the test does not hang on a CPU.
DIVERGENCE = 1.5


def _run(variant, seed, status="finished", loss=None, parent=None, drift=None):
    meta = {"variant": variant, "seed": seed, "final": {"val_loss": loss, "step": 10} if loss is not None else None,
            "stop_reason": None if status == "finished" else "loss 40 > 3 x the first loss 6", "stopped_at": 7}
    if drift:
        meta["lock_drift"] = drift
    if parent:
        meta["retry_of"] = parent
    return {"run_id": f"r-{variant}-{seed}-{status}-{parent}", "status": status, "parent_id": parent, "meta": meta}


# -- the conclusion (pure) ----------------------------------------------------------------------

def test_a_failed_run_is_unanswered_until_a_later_attempt_of_its_pair_has_a_result():
    def row(n, status, variant, seed):
        return {"run_id": f"c-r{n:02d}", "status": status, "meta": {"variant_index": variant, "seed": seed}}

    def ids(runs):
        return [r["run_id"] for r in unanswered_failures(runs)]

    runs = [row(1, "finished", 0, 1), row(2, "failed", 0, 2), row(3, "diverged", 1, 1), row(4, "stopped", 1, 2),
            row(5, "not-run", 2, 1), row(6, "failed", 2, 2)]
    assert ids(runs) == ["c-r02", "c-r06"]  # a divergence, a stop and a run not started are not failures
    runs.append(row(7, "failed", 0, 2))  # a retry of r02 that failed too: the pair's latest failure is named
    assert ids(runs) == ["c-r07", "c-r06"]
    runs += [row(8, "stopped", 0, 2), row(9, "refused", 2, 2)]  # cut short or refused: still no result
    assert ids(runs) == ["c-r07", "c-r06"]
    runs += [row(10, "finished", 0, 2), row(11, "diverged", 2, 2)]  # a retry of r02 again: the pair has its answer
    assert ids(runs) == []
    runs.append(row(12, "failed", 0, 1))  # a changed retry of a finished seed that failed: the last word is a failure
    assert ids(runs) == ["c-r12"]


def test_the_campaigns_exit_code_is_1_while_a_failure_is_unanswered_and_names_it(capsys):
    from pilotrun.cli.campaign import _exit_code

    def row(n, status, seed, reason=None):
        return {"run_id": f"c-r{n:02d}", "status": status, "meta": {"variant_index": 0, "seed": seed,
                                                                       "stop_reason": reason}}

    result = {"campaign_id": "c", "runs": [row(1, "finished", 1), row(2, "failed", 2, "building the job raised X")]}
    assert _exit_code(result) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "1 run(s) failed: c-r02 (building the job raised X)" in err and "pilotrun campaign c --retry RUN" in err
    result["runs"].append(row(3, "finished", 2))
    assert _exit_code(result) == 0 and capsys.readouterr().err == ""


def test_a_lower_mean_within_seed_spread_does_not_beat_the_control():
    runs = [_run("a", 1, loss=2.00), _run("a", 2, loss=2.20), _run("b", 1, loss=1.95), _run("b", 2, loss=2.15)]
    c = conclude("lr", ["a", "b"], runs)
    assert c["variants"][1]["beats_control"] is False
    assert c["text"][0] == "no variant beat the control (lr = a) beyond seed spread"
    # The best single seed of b (1.95) beats the control's mean; the conclusion uses means, not best seeds.
    assert c["variants"][1]["val_loss_mean"] == pytest.approx(2.05)


def test_a_variant_beyond_seed_spread_is_named_with_its_margin():
    runs = [_run("a", 1, loss=2.0), _run("a", 2, loss=2.02), _run("b", 1, loss=1.5), _run("b", 2, loss=1.52)]
    c = conclude("lr", ["a", "b"], runs)
    assert c["variants"][1]["beats_control"] is True
    assert c["text"][0].startswith("lr = b beat the control (a) by 0.5")


def test_diverged_runs_are_counted_and_one_seed_declares_no_winner():
    runs = [_run("a", 1, loss=2.0), _run("b", 1, loss=1.0), _run("c", 1, status="diverged")]
    c = conclude("lr", ["a", "b", "c"], runs)
    assert "no seed spread" in c["text"][0] and not c["variants"][1]["beats_control"]
    assert c["variants"][2]["diverged"] == 1 and c["variants"][2]["val_loss_mean"] is None
    assert any("lr = c diverged in 1 of 1 run(s) (update 7)" in line for line in c["text"])


def test_a_variant_that_never_finished_is_said_to_be_not_compared_not_beaten():
    from pilotrun.campaign.conclude import table

    runs = [_run("a", 1, loss=2.0), _run("a", 2, loss=2.1), _run("b", 1, status="stopped"),
            _run("b", 2, status="not-run"), _run("c", 1, loss=2.05), _run("c", 2, loss=2.06)]
    c = conclude("lr", ["a", "b", "c"], runs)
    assert c["text"][:2] == ["no variant beat the control (lr = a) beyond seed spread",
                             "not compared (fewer than 2 seeds finished alongside the control): lr = b"]
    assert [row[-1] for row in table(c)] == ["", "not compared", "no"]


def test_parallel_runs_are_capped_by_cores_and_measured_memory_with_reasons():
    from pilotrun.campaign.resources import PerRun, plan_parallel

    gib = 2**30
    p = plan_parallel(4, cpus=2, host_available_bytes=20 * gib, accelerator=None, per_run=None)
    assert (p["parallel"], p["threads_per_run"]) == (2, 1) and "2 CPU core(s)" in p["reasons"][0]
    assert "no pilot of the base spec" in p["not_checked"][0] and p["text"] == "2 run(s) at once (asked 4), 1 CPU thread(s) each"
    p = plan_parallel(8, cpus=16, host_available_bytes=10 * gib, accelerator=None,
                      per_run=PerRun(host_bytes=3 * gib, device_bytes=None, source="pilot-1"))
    assert p["parallel"] == 3 and "one run peaked at 3.0 GiB in pilot pilot-1" in p["reasons"][0]  # 0.9 x 10 / 3
    assert (p["threads_per_run"], p["not_checked"]) == (5, [])
    assert p["checked"] == ["16 CPU core(s): more CPU runs than cores only makes each slower: room for 16",
                            "host memory: 10.0 GiB available, one run peaked at 3.0 GiB in pilot pilot-1: room for 3"]
    p = plan_parallel(4, cpus=16, host_available_bytes=100 * gib, accelerator=("NVIDIA H100 80GB HBM3", 80 * gib),
                      per_run=PerRun(host_bytes=2 * gib, device_bytes=30 * gib, source="pilot-2"))
    assert p["parallel"] == 2 and "NVIDIA H100 80GB HBM3: 80.0 GiB, one run reserved 30.0 GiB" in p["reasons"][0]
    p = plan_parallel(2, cpus=16, host_available_bytes=100 * gib, accelerator=("NVIDIA H100 80GB HBM3", 80 * gib),
                      per_run=PerRun(host_bytes=2 * gib, device_bytes=None, source="cpu-pilot"))
    assert p["parallel"] == 2 and "memory not checked: pilot cpu-pilot has no device measurement" in p["not_checked"][0]
    p = plan_parallel(2, cpus=4, host_available_bytes=1 * gib, accelerator=None,
                      per_run=PerRun(host_bytes=2 * gib, device_bytes=None, source="big"))
    assert p["parallel"] == 1 and p["reasons"][-1] == "even one run may not fit; running one at a time"


def test_the_memory_one_run_needs_comes_from_a_pilot_of_the_same_spec(tmp_path):
    from pilotrun.campaign.resources import pilot_memory
    from pilotrun.ledger import Ledger

    with Ledger(tmp_path / "l.sqlite") as led:
        led.start_run("p1", "job", "pilot", config_hash="h")
        for gate, rss, dev in (("load", 100, None), ("steady_step", 300, 7000), ("resume", 900, 9000)):
            led.add_gate_row("p1", {"gate": gate, "verdict": "pass", "reason": "", "inputs": {},
                                    "memory": {"host_rss_peak_bytes": rss, "peak_reserved_bytes": dev}})
        led.start_run("p2", "job", "pilot", config_hash="other")
        got = pilot_memory(led, "h")
        # resume runs three processes: not what one campaign run needs
        assert (got.host_bytes, got.device_bytes, got.source) == (300, 7000, "p1")
        assert pilot_memory(led, "nothing") is None


def test_one_finished_seed_or_unmatched_seeds_never_declare_a_winner():
    # The variant finished only seed 1 (seed 2 stopped): a huge difference on one seed is no verdict.
    runs = [_run("a", 1, loss=5.0), _run("a", 2, loss=5.1), _run("b", 1, loss=1.0), _run("b", 2, status="stopped")]
    c = conclude("lr", ["a", "b"], runs)
    assert not c["variants"][1]["beats_control"]
    assert c["text"][0] == ("no variant could be compared to the control (lr = a): none finished 2 or more of the "
                            "seeds the control finished")
    # Seeds {2, 3} against the control's {1, 2}: only seed 2 pairs, so again no verdict.
    runs = [_run("a", 1, loss=5.0), _run("a", 2, loss=5.1), _run("b", 2, loss=1.0), _run("b", 3, loss=1.1)]
    assert conclude("lr", ["a", "b"], runs)["variants"][1]["paired_seeds"] == [2]
    # Paired over the common seeds only: seed 3 of the control (finished alone) does not enter the comparison.
    runs = [_run("a", 1, loss=5.0), _run("a", 2, loss=5.2), _run("a", 3, loss=9.0),
            _run("b", 1, loss=1.0), _run("b", 2, loss=1.1), _run("b", 3, status="diverged")]
    c = conclude("lr", ["a", "b"], runs)
    b = c["variants"][1]
    assert b["paired_seeds"] == [1, 2] and b["beats_control"] and abs(b["difference_vs_control"] + 4.05) < 1e-9
    assert c["text"][0].endswith("over 2 paired seeds")


def test_every_variant_diverged_is_said_plainly():
    runs = [_run("a", 1, loss=5.0), _run("a", 2, loss=5.1), _run("b", 1, status="diverged"),
            _run("b", 2, status="diverged")]
    c = conclude("lr", ["a", "b"], runs)
    assert c["text"][0] == "no variant beat the control (lr = a): every variant diverged"


def test_retrying_a_finished_seed_cannot_move_the_result():
    runs = [_run("a", 1, loss=2.0), _run("a", 2, loss=2.02), _run("b", 1, loss=2.0), _run("b", 2, loss=2.04),
            _run("b", 2, loss=0.1, parent="r-b-2-finished-None")]  # a lucky retry of a seed that had finished
    c = conclude("lr", ["a", "b"], runs)
    b = c["variants"][1]
    assert b["val_loss_mean"] == pytest.approx(2.02) and b["finished"] == 2 and b["retries"] == 1
    assert not b["beats_control"]


def test_the_retry_of_a_diverged_seed_counts_and_drifted_runs_do_not():
    runs = [_run("a", 1, loss=2.0), _run("a", 2, loss=2.02), _run("b", 1, status="diverged"),
            _run("b", 1, loss=1.0, parent="r-b-1-diverged-None"), _run("b", 2, loss=1.0, drift=["versions.torch"])]
    b = conclude("lr", ["a", "b"], runs)["variants"][1]
    assert b["finished"] == 1 and b["val_loss_mean"] == pytest.approx(1.0) and b["lock_drift"] == 1
    assert b["diverged"] == 1 and b["retries"] == 1


def test_a_resume_continues_only_runs_cut_short_and_they_stop_counting_as_not_run():
    from pilotrun.campaign.followup import cut_short

    def row(rid, index, seed, status, continues=None):
        meta = {"variant": ["a", "b"][index], "variant_index": index, "seed": seed, "stop_reason": "why", "stopped_at": 7,
                "final": {"val_loss": 2.0 + index + seed / 100} if status == "finished" else None}
        if continues:
            meta["continues"] = continues
        return {"run_id": rid, "status": status, "parent_id": continues, "meta": meta}

    runs = [row("r1", 0, 1, "finished"), row("r2", 0, 2, "stopped"), row("r3", 1, 1, "diverged"),
            row("r4", 1, 2, "not-run")]
    assert [r["run_id"] for r in cut_short(runs)] == ["r2", "r4"]  # a divergence is a result: --retry, not resume
    runs += [row("r5", 0, 2, "finished", continues="r2"), row("r6", 1, 2, "stopped", continues="r4")]
    assert [r["run_id"] for r in cut_short(runs)] == ["r6"]  # interrupted again: its latest attempt goes next
    runs.append(row("r7", 1, 2, "finished", continues="r6"))
    assert cut_short(runs) == []
    c = conclude("lr", ["a", "b"], runs)
    a, b = c["variants"]
    assert (a["finished"], a["not_run"], a["continued"], a["retries"]) == (2, 0, 1, 0)
    assert (b["runs"], b["finished"], b["not_run"], b["continued"], b["diverged"]) == (2, 1, 0, 1, 1)
    assert "lr = b: 1 seed(s) cut short by an interruption ran again from the start (--resume), each run linked " \
           "to the one it continues" in c["text"]
    assert "lr = b diverged in 1 of 2 run(s) (update 7); those runs are kept with their reason" in c["text"]
    assert not any("stopped or not run" in line for line in c["text"])


# -- the campaign file (parsed and checked before anything runs) ----------------------------------

def _campaign(tmp_path, **over) -> Path:
    copy_example("tiny-sft", tmp_path)
    body = {"name": "sweep", "base": "tiny-sft/pilot.yaml", "vary": {"train.optimizer.lr": LRS}, "seeds": [1, 2],
            "updates": 12, "eval": {"every": 6}, "stop": {"non_finite": True, "divergence": DIVERGENCE,
                                                            "budget_minutes": 20},
            "keep": {"checkpoint": False, "export": True, "control_set": 4}}
    body.update(over)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


@pytest.mark.parametrize("over, field", [
    ({"vary": {"train.optimizer.lr": [1e-3, 2e-3], "seed": [1, 2]}}, "vary"),
    ({"vary": {"train.optimizer.lr": [1e-3]}}, "vary.train.optimizer.lr"),
    ({"stop": {"divergence": 0.5}}, "stop.divergence"),
    ({"seeds": [1, 1]}, "seeds"),
    ({"updates": 0}, "updates"),
    ({"stop": {"budget": 3}}, "stop.budget"),
    # Names as pilot names: one folder under --out (never above it), never empty, never longer than a run id allows.
    ({"name": "../../escaped"}, "name"),
    ({"name": ""}, "name"),
    ({"name": "a/b"}, "name"),
    ({"name": "x" * 300}, "name"),
])
def test_a_wrong_campaign_file_names_the_field(tmp_path, over, field):
    with pytest.raises(SpecError) as err:
        load_campaign(_campaign(tmp_path, **over))
    assert field in [f for f, _ in err.value.problems], err.value.problems


@pytest.mark.parametrize("key, values, why", [
    ("train.micro_batch_size", [8, 4], "examples per update are fixed"),
    ("train.updates", [10, 20], "the same update budget"),
    ("data.val_fraction", [0.1, 0.3], "a campaign fixes the data"),
    ("data.path", ["a.jsonl", "b.jsonl"], "a campaign fixes the data"),
    ("eval.max_batches", [20, 1], "the yardstick every run is judged by"),
    ("model.config", [{"model_type": "llama"}, {"model_type": "gpt2"}], "a campaign fixes the model"),
    ("model.config.hidden_size", [64, 128], "a campaign fixes the model"),
    ("seed", [1, 2], "seeds are listed under seeds"),
    ("train.optimizer.lr", [3.0e-3, 3.0e-3], "values repeat"),
])
def test_a_variant_that_would_change_what_the_campaign_fixes_is_refused_before_the_start(tmp_path, key, values, why):
    with pytest.raises(SpecError) as exc:
        load_campaign(_campaign(tmp_path, vary={key: values}))
    assert exc.value.problems[0][0] == f"vary.{key}" and why in exc.value.problems[0][1], exc.value.problems


def test_a_dict_valued_key_and_a_dropout_can_be_varied(tmp_path):
    c = load_campaign(_campaign(tmp_path, vary={"train.scheduler": [{"name": "cosine", "warmup_updates": 2},
                                                                    {"name": "constant"}]}))
    assert prepare(c)[1] == []  # the scheduler's own sub-keys are the varied key, not "also changed"
    (tmp_path / "b").mkdir()
    c = load_campaign(_campaign(tmp_path / "b", vary={"model.config.attention_dropout": [0.0, 0.1]}))
    assert prepare(c)[1] == []


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_stop_signal_reaches_the_campaign_as_an_interrupt_and_the_old_handlers_come_back(sig):
    # SIGTERM from `timeout` or a scheduler, SIGHUP from a dropped SSH session: both must end in the
    # interrupt path that records every run, not kill the campaign with its rows left "running".
    import os
    import signal
    import time

    from pilotrun.interrupt import Interrupted, interruptible

    signum = getattr(signal, sig)

    def unhandled(*_):  # what would otherwise end the test process: a plain failure instead
        raise RuntimeError(f"{sig} was not handled by the campaign")

    outer = signal.signal(signum, unhandled)

    @interruptible()
    def campaign_body():
        os.kill(os.getpid(), signum)
        time.sleep(10)  # the handler raises before this ends

    started = time.monotonic()
    try:
        with pytest.raises(Interrupted) as stop:
            campaign_body()
        assert time.monotonic() - started < 5 and signal.getsignal(signum) is unhandled
        # A KeyboardInterrupt (every recording path catches it) that names the signal and its exit status.
        assert isinstance(stop.value, KeyboardInterrupt) and stop.value.name == sig
        assert stop.value.exit_code == 128 + signum and stop.value.how == sig
    finally:
        signal.signal(signum, outer)


def test_a_warm_up_longer_than_the_runs_is_warned_before_the_start_and_kept_as_a_caveat(tmp_path):
    from pilotrun.campaign.orchestrate import warnings_for

    c = load_campaign(_campaign(tmp_path, vary={"train.scheduler.warmup_updates": [2, 20]}, updates=10))
    runs, problems = prepare(c)
    assert problems == []
    (w,) = warnings_for(c, runs)
    assert w.startswith("train.scheduler.warmup_updates = 20: the warm-up (20 updates) is not over by the campaign's 10")
    text = conclude("k", ["a"], [_run("a", 1, loss=1.0)], caveats=[w])["text"]
    assert text[-1] == "caveat: " + w


def test_a_broken_base_is_blamed_on_the_base(tmp_path):
    path = _campaign(tmp_path)
    base = tmp_path / "tiny-sft" / "pilot.yaml"
    base.write_text(base.read_text().replace("micro_batch_size:", "micro_batch_sise:"))
    with pytest.raises(SpecError) as exc:
        load_campaign(path)
    field, msg = exc.value.problems[0]
    assert field == "base" and msg.startswith("tiny-sft/pilot.yaml is not a valid pilot spec: ") and "sise" in msg


def test_a_variant_that_is_not_a_valid_spec_names_the_key(tmp_path):
    c = load_campaign(_campaign(tmp_path, vary={"train.optimiser.lr": [1e-3, 2e-3]}))
    with pytest.raises(CampaignError, match="train.optimiser.lr = 0.001 does not give a valid spec: train.optimiser"):
        prepare(c)


@pytest.mark.process
def test_a_campaign_name_that_would_leave_out_is_exit_2_and_writes_nothing(tmp_path):
    path = _small(tmp_path, name="../../escaped")
    out = tmp_path / "a" / "b" / "runs"
    res = pilotrun_cli("campaign", str(path), "--ledger", str(tmp_path / "l.sqlite"), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert "name:" in res.stderr and "no path separator and no '..'" in " ".join(res.stderr.split())
    assert not list(tmp_path.rglob("escaped*")) and not out.exists()


# -- one real campaign ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    work = tmp_path_factory.mktemp("campaign")
    spec = _campaign(work)
    ledger = work / "ledger.sqlite"
    res = pilotrun_cli("campaign", str(spec), "--parallel", "2", "--ledger", str(ledger), "--out", str(work / "runs"),
                       "--json", cwd=work, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    runs = {r["meta"]["variant"]: [] for r in out["runs"]}
    for r in out["runs"]:
        runs[r["meta"]["variant"]].append(r)
    return {"work": work, "ledger": ledger, "id": out["campaign_id"], "out": out, "by_lr": runs}


@pytest.mark.process
def test_every_run_is_kept_with_its_reason_and_the_conclusion_is_honest(campaign):
    out, by_lr = campaign["out"], campaign["by_lr"]
    assert [r["run_id"] for r in out["runs"]] == [f"{campaign['id']}-r{i:02d}" for i in range(1, 7)]
    assert [(r["meta"]["variant"], r["meta"]["seed"]) for r in out["runs"]] == [(lr, s) for lr in LRS for s in (1, 2)]
    assert all(r["status"] == "finished" for lr in LRS[:2] for r in by_lr[lr])
    for r in by_lr[1.0]:  # the diverged variant: kept, with why and where
        assert r["status"] == "diverged", r
        assert "x the first loss" in r["meta"]["stop_reason"] and 1 <= r["meta"]["stopped_at"] <= 12
    text = out["conclusion"]["text"]
    assert text[0] == "no variant beat the control (train.optimizer.lr = 0.003) beyond seed spread", text
    assert any(line.startswith("train.optimizer.lr = 1.0 diverged in 2 of 2 run(s)") for line in text)
    control = out["conclusion"]["variants"][0]
    assert control["finished"] == 2 and control["val_loss_std"] is not None
    # Declared before the start and stored: the campaign row holds the whole declaration.
    camp = ledger_rows(campaign["ledger"], "SELECT * FROM runs WHERE run_id = ?", campaign["id"])[0]
    declared = json.loads(camp["meta_json"])["campaign"]
    assert declared["stop"] == {"non_finite": True, "divergence": DIVERGENCE, "budget_minutes": 20}
    assert declared["vary"] == {"train.optimizer.lr": LRS} and declared["updates"] == 12


@pytest.mark.process
def test_parallel_runs_wrote_every_update_once_and_kept_what_was_asked(campaign):
    for r in campaign["out"]["runs"]:
        rows = ledger_rows(campaign["ledger"],
                           "SELECT * FROM metrics WHERE run_id = ? AND gate = 'train' ORDER BY step", r["run_id"])
        last = r["meta"]["stopped_at"] if r["status"] == "diverged" else 12
        assert [m["step"] for m in rows] == list(range(1, last + 1)), r["run_id"]  # no lost, no duplicated rows
        assert all(m["lr"] > 0 and m["grad_norm"] is not None and json.loads(m["extra_json"])["examples_per_second"] > 0
                   for m in rows)
        val = ledger_rows(campaign["ledger"], "SELECT step FROM metrics WHERE run_id = ? AND gate = 'val'", r["run_id"])
        folder = campaign["work"] / "runs" / campaign["id"] / r["run_id"]
        preds = json.loads((folder / "predictions.json").read_text())
        assert len(preds) == 4 and all("predicted_tokens" in p for p in preds)
        meta = json.loads(ledger_rows(campaign["ledger"], "SELECT meta_json FROM runs WHERE run_id = ?",
                                      r["run_id"])[0]["meta_json"])
        if r["status"] == "finished":
            assert [v["step"] for v in val] == [6, 12]
            assert (folder / "export" / "model.safetensors").is_file()
            assert r["meta"]["final"]["step"] == 12
            # Its export's manifest is recorded in its row, as a pilot's export row records it: the policy knows it.
            sha = hashlib.sha256((folder / "export" / "manifest.json").read_bytes()).hexdigest()
            assert meta["manifests"] == {"export": sha}, meta.get("manifests")
            with Ledger(campaign["ledger"]) as led:
                assert sha in LoadPolicy.from_ledger(led).known
        else:
            assert not (folder / "export").exists()  # a diverged model is not kept as an artifact
    # --parallel 2 on this machine: capped by its cores only, memory unchecked (no pilot of the base spec here).
    from pilotrun.devices import query_host

    at_once = campaign["out"]["parallel"]
    cpus = query_host().cpus
    assert at_once["parallel"] == min(2, cpus) and at_once["threads_per_run"] == max(1, cpus // min(2, cpus))
    assert at_once["not_checked"] and "no pilot of the base spec" in at_once["not_checked"][0]
    plan = json.loads((campaign["work"] / "runs" / campaign["id"] / "plan.json").read_text())
    assert plan["threads"] == at_once["threads_per_run"]  # what each worker set torch to


@pytest.mark.process
def test_a_retry_is_a_new_run_linked_to_its_parent(campaign):
    parent = campaign["by_lr"][1.0][0]
    # The base spec and the campaign file were edited since the start: the retry must not pick that up.
    base = campaign["work"] / "tiny-sft" / "pilot.yaml"
    written = base.read_text()
    try:
        base.write_text(written.replace("weight_decay: 0.01", "weight_decay: 0.5"))
        assert "weight_decay: 0.5" in base.read_text()
        res = pilotrun_cli("campaign", campaign["id"], "--retry", parent["run_id"].rsplit("-", 1)[1],  # "r05"
                           "--set", "train.micro_batch_size=4", "--set", "train.grad_accum_steps=4",
                           "--ledger", str(campaign["ledger"]), "--json", cwd=campaign["work"], timeout=300)
    finally:
        base.write_text(written)
    assert res.returncode == 0, res.stdout + res.stderr
    retry_spec = json.loads((campaign["work"] / "runs" / campaign["id"] / f"{campaign['id']}-r07" / "spec.json")
                            .read_text())
    assert retry_spec["written"]["train"]["optimizer"]["weight_decay"] == 0.01, retry_spec["written"]["train"]
    runs = json.loads(res.stdout)["runs"]
    assert len(runs) == 7 and runs[-1]["run_id"] == f"{campaign['id']}-r07"
    assert runs[-1]["parent_id"] == parent["run_id"]
    assert runs[-1]["meta"]["changes"] == {"train.micro_batch_size": 4, "train.grad_accum_steps": 4}
    assert runs[-1]["meta"]["variant"] == 1.0 and runs[-1]["meta"]["seed"] == parent["meta"]["seed"]
    assert runs[-1]["status"] in ("finished", "diverged")
    before = next(r for r in runs if r["run_id"] == parent["run_id"])
    assert before["status"] == "diverged" and before["meta"]["stop_reason"] == parent["meta"]["stop_reason"]
    # A retry that would change the experiment is refused, naming the key.
    res = pilotrun_cli("campaign", campaign["id"], "--retry", parent["run_id"], "--set", "train.optimizer.lr=0.5",
                       "--ledger", str(campaign["ledger"]), cwd=campaign["work"])
    assert res.returncode == 2 and "train.optimizer.lr would make it another experiment" in " ".join(res.stderr.split())
    assert "Traceback" not in res.stderr
    res = pilotrun_cli("campaign", campaign["id"], "--retry", parent["run_id"], "--set", "train.micro_batch_size=4",
                       "--ledger", str(campaign["ledger"]), cwd=campaign["work"])
    assert res.returncode == 2 and "examples per update (16 -> 8)" in res.stderr
    finished = campaign["by_lr"][LRS[0]][0]["run_id"]
    res = pilotrun_cli("campaign", campaign["id"], "--retry", finished, "--ledger", str(campaign["ledger"]),
                       cwd=campaign["work"])
    assert res.returncode == 2 and "an identical rerun would not count" in res.stderr
    assert len(ledger_rows(campaign["ledger"], "SELECT * FROM runs WHERE kind = 'campaign-run'")) == 7


@pytest.mark.process
def test_the_report_is_self_contained_with_every_run_the_note_and_each_runs_own_page(campaign):
    work = campaign["work"]
    res = pilotrun_cli("note", "kept the control: 1e-3 is slower, 1.0 diverges", "--run", campaign["id"],
                       "--ledger", str(campaign["ledger"]), cwd=work)
    assert res.returncode == 0, res.stderr
    html = work / "campaign.html"
    res = pilotrun_cli("report", campaign["id"], "--ledger", str(campaign["ledger"]), "--out", str(html), cwd=work)
    assert res.returncode == 0, res.stdout + res.stderr
    page = html.read_text()
    assert "src=\"http" not in page and "<script src" not in page  # self-contained
    for run in campaign["out"]["runs"]:
        assert run["run_id"] in page
    assert "kept the control: 1e-3 is slower, 1.0 diverges" in page
    # One run of it: its own page (what it varied, where it stopped, its curves), not a pilot's gate table.
    bad = campaign["by_lr"][1.0][0]
    res = pilotrun_cli("report", bad["run_id"], "--ledger", str(campaign["ledger"]), "--out", str(work / "r.html"),
                       cwd=work)
    assert res.returncode == 0, res.stderr
    page = (work / "r.html").read_text()
    assert f"Campaign run: {bad['run_id']}" in page and html_escape(bad["meta"]["stop_reason"]) in page
    # Its curves: loss and lr, and validation loss when it lived to the first validation (update 6).
    val = ledger_rows(campaign["ledger"], "SELECT step FROM metrics WHERE run_id = ? AND gate = 'val'", bad["run_id"])
    assert "Pilot:" not in page and page.count("data:image/png") == 2 + bool(val)
    res = pilotrun_cli("ledger", "--ledger", str(campaign["ledger"]), cwd=work)
    assert res.returncode == 0 and f"seed {bad['meta']['seed']} · update {bad['meta']['stopped_at']}:" in res.stdout


@pytest.mark.process
@pytest.mark.browser
def test_the_report_renders_in_a_real_browser(campaign):
    work = campaign["work"]
    html = work / "campaign-browser.html"
    res = pilotrun_cli("report", campaign["id"], "--ledger", str(campaign["ledger"]), "--out", str(html), cwd=work)
    assert res.returncode == 0, res.stdout + res.stderr
    dom, console, shot = open_in_chromium(html, work)
    assert 'data-images-decoded="' in dom, dom[:500]
    images = int(dom.split('data-images="')[1].split('"')[0])
    decoded = int(dom.split('data-images-decoded="')[1].split('"')[0])
    assert images >= 2 and decoded == images  # train and validation curves, each decoded by the browser
    assert "diverged" in dom and "beyond seed spread" in dom
    assert not [c for c in console if "Uncaught" in c or "rror" in c], console
    from PIL import Image

    with Image.open(shot) as img:  # the page painted: not one flat colour
        colours = img.convert("RGB").resize((120, 240)).getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50


@pytest.mark.process
def test_archive_reloads_in_a_fresh_process_and_says_why_a_diverged_run_has_no_model(campaign):
    work = campaign["work"]
    good, bad = campaign["by_lr"][LRS[0]][0], campaign["by_lr"][1.0][0]
    for r in (good, bad):
        res = pilotrun_cli("archive", r["run_id"], "--ledger", str(campaign["ledger"]),
                           "--out", str(work / f"{r['run_id']}.tar.gz"), "--json", cwd=work)
        assert res.returncode == 0, res.stdout + res.stderr
    dest = work / "unpacked"
    with tarfile.open(work / f"{good['run_id']}.tar.gz") as tar:
        tar.extractall(dest, filter="data")
    root = dest / good["run_id"]
    for name in ("model/model.safetensors", "model/config.json", "model/tokenizer.json", "config/pilot.yaml",
                 "config/spec.json", "config/campaign.json", "lock.json", "metrics.csv", "gates.csv", "run.json",
                 "control/inputs.safetensors", "control/outputs.safetensors", "rerun_control.py", "README.md"):
        assert (root / name).is_file(), name
    metrics = list(csv.DictReader(io.StringIO((root / "metrics.csv").read_text())))
    assert [int(m["step"]) for m in metrics if m["gate"] == "train"] == list(range(1, 13))
    readme = (root / "README.md").read_text()
    assert "python rerun_control.py" in readme and "LlamaForCausalLM" in readme
    # The archive stands alone: a fresh interpreter in another folder, no pilotrun import.
    rerun = subprocess.run([sys.executable, "-I", str(root / "rerun_control.py")], cwd=dest, capture_output=True,
                           text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert rerun.returncode == 0 and "match: LlamaForCausalLM reproduces the recorded outputs on 4" in rerun.stdout, \
        rerun.stdout + rerun.stderr
    with tarfile.open(work / f"{bad['run_id']}.tar.gz") as tar:
        names = tar.getnames()
        readme = tar.extractfile(f"{bad['run_id']}/README.md").read().decode()
    assert not any("/model/" in n for n in names) and f"{bad['run_id']}/metrics.csv" in names
    assert f"There is no model in this archive: the run diverged at update {bad['meta']['stopped_at']}" in readme
    # The whole campaign: every run (the diverged ones without a model, saying why), the conclusion, the report.
    res = pilotrun_cli("archive", campaign["id"], "--ledger", str(campaign["ledger"]), "--out",
                       str(work / "campaign.tar.gz"), "--json", cwd=work)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads(res.stdout)
    rows = ledger_rows(campaign["ledger"], "SELECT status FROM runs WHERE run_id LIKE ?", campaign["id"] + "-r%")
    assert summary["runs"] == len(rows) >= 6  # retries from other tests included
    assert summary["models"] == sum(r["status"] == "finished" for r in rows) >= 4
    with tarfile.open(work / "campaign.tar.gz") as tar:
        names = set(tar.getnames())
        readme = tar.extractfile(f"{campaign['id']}/README.md").read().decode()
    top = campaign["id"]
    for name in ("README.md", "report.html", "conclusion.json", "config/campaign.json", "runs.csv", "metrics.csv",
                 f"runs/{good['run_id']}/model/model.safetensors", f"runs/{good['run_id']}/rerun_control.py",
                 f"runs/{bad['run_id']}/README.md"):
        assert f"{top}/{name}" in names, name
    assert not any(n.startswith(f"{top}/runs/{bad['run_id']}/model") for n in names)
    assert "no variant beat the control" in readme and f"| {bad['run_id']} |" in readme and "diverged" in readme


@pytest.mark.process
def test_archive_refuses_a_model_that_no_longer_matches_its_manifest(campaign, tmp_path):
    r = campaign["by_lr"][LRS[1]][1]
    weights = campaign["work"] / "runs" / campaign["id"] / r["run_id"] / "export" / "model.safetensors"
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-8] + b"\0" * 8)
        res = pilotrun_cli("archive", r["run_id"], "--ledger", str(campaign["ledger"]),
                           "--out", str(tmp_path / "x.tar.gz"), cwd=tmp_path)
        assert res.returncode == 2 and "model.safetensors" in res.stderr and "Traceback" not in res.stderr
        assert not (tmp_path / "x.tar.gz").exists()
    finally:
        weights.write_bytes(original)


def _rehash(folder: Path) -> str:
    """Rewrite ``folder``'s manifest to match its files (what an attacker would do); its new sha256."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"] = {str(p.relative_to(folder)): {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                                                      "bytes": p.stat().st_size}
                         for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "manifest.json"}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()


def _named_factory(export: Path, factory: str, mapping, spec_folder: Path) -> str:
    (export / "export.json").write_text(json.dumps({"factory": factory, "model": mapping,
                                                    "spec_folder": str(spec_folder)}))
    return _rehash(export)


@pytest.mark.process
def test_archive_refuses_a_campaign_export_rewritten_after_the_run(campaign, tmp_path):
    r = campaign["by_lr"][LRS[1]][0]
    export = campaign["work"] / "runs" / campaign["id"] / r["run_id"] / "export"
    pristine = tmp_path / "pristine"
    shutil.copytree(export, pristine)
    marker, secrets = tmp_path / "MARKER", tmp_path / "somedir"
    (secrets / "secrets").mkdir(parents=True)
    (secrets / "secrets" / "key.txt").write_text("not the run's\n")
    stdlib = Path(os.__file__).parent
    try:
        for factory, mapping, folder in (("os:system", f"touch {marker}", stdlib), ("secrets:x", {}, secrets)):
            _named_factory(export, factory, mapping, folder)
            out = tmp_path / f"{factory.split(':')[0]}.tar.gz"
            res = pilotrun_cli("archive", r["run_id"], "--ledger", str(campaign["ledger"]), "--out", str(out),
                               cwd=tmp_path)
            err = " ".join(res.stderr.split())
            assert res.returncode == 2 and "Traceback" not in res.stderr, (factory, res.stdout, res.stderr)
            assert "export/manifest.json is not the manifest the ledger recorded" in err, err
            assert not out.exists() and not marker.exists()
    finally:
        shutil.rmtree(export)
        shutil.copytree(pristine, export)


def _rerun(root: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *(["-I"] if not env else []), str(root / "rerun_control.py")], cwd=root,
                          capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", **env})


def _recorded(root: Path, sha: str) -> None:
    """The archive's record rewritten too, so rerun_control reaches its factory and remote-code checks."""
    run = json.loads((root / "run.json").read_text())
    run["recorded"]["model_manifest_sha256"] = sha
    (root / "run.json").write_text(json.dumps(run))


@pytest.mark.process
def test_rerun_control_loads_only_the_recorded_model_and_runs_no_code_it_names(campaign, tmp_path):
    good = campaign["by_lr"][LRS[0]][1]
    res = pilotrun_cli("archive", good["run_id"], "--ledger", str(campaign["ledger"]), "--out",
                       str(tmp_path / "a.tar.gz"), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        tar.extractall(tmp_path / "x", filter="data")
    root, marker = tmp_path / "x" / good["run_id"], tmp_path / "MARKER"
    assert json.loads((root / "run.json").read_text())["recorded"]["factory"] is None  # a Hugging Face model
    # An export.json naming os:system in the unpacked archive: not the recorded manifest, nothing loaded.
    sha = _named_factory(root / "model", "os:system", f"touch {marker}", Path(os.__file__).parent)
    rerun = _rerun(root)
    assert rerun.returncode == 2 and "REFUSED" in rerun.stderr and "not the manifest recorded" in rerun.stderr, \
        rerun.stdout + rerun.stderr
    _recorded(root, sha)  # recorded, it still names a factory the run's spec does not
    rerun = _rerun(root)
    assert rerun.returncode == 2 and "names the factory 'os:system'" in rerun.stderr, rerun.stdout + rerun.stderr
    # An adapter whose base.json spec asks transformers to run a folder's own code (configuration_*.py).
    evil = tmp_path / "evilhf"
    evil.mkdir()
    (evil / "configuration_evil.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    (evil / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {
        "AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "configuration_evil.EvilConfig"}}))
    for f in (root / "model").iterdir():
        if f.name != "manifest.json":
            f.unlink()
    base = campaign["work"] / "tiny-sft" / "pilot.yaml"
    written = {**yaml.safe_load(base.read_text()), "model": {"hf": str(evil), "trust_remote_code": True}}
    (root / "model" / "base.json").write_text(json.dumps({"spec": {"written": written, "source": str(base)},
                                                         "base_identity": "x", "head": "causal-lm"}))
    (root / "model" / "adapter_config.json").write_text("{}")
    (root / "model" / "adapter_model.safetensors").write_bytes(b"")
    _recorded(root, _rehash(root / "model"))
    rerun = _rerun(root, PYTHONPATH=os.environ.get("PYTHONPATH", ""), HOME=str(tmp_path))
    assert rerun.returncode == 2 and "trust_remote_code" in rerun.stderr, rerun.stdout + rerun.stderr[-3000:]
    assert not marker.exists(), "code an artifact named was run"


@pytest.mark.process
def test_an_archive_never_follows_a_link_out_of_the_campaign_and_names_what_it_left(campaign, tmp_path):
    r = campaign["by_lr"][LRS[0]][0]
    camp = campaign["work"] / "runs" / campaign["id"] / "campaign.json"
    kept = tmp_path / "campaign.json"
    shutil.copyfile(camp, kept)
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the campaign folder\n")
    camp.unlink()
    camp.symlink_to(secret)
    try:
        out = tmp_path / "a.tar.gz"
        res = pilotrun_cli("archive", r["run_id"], "--ledger", str(campaign["ledger"]), "--out", str(out),
                           cwd=tmp_path)
    finally:
        camp.unlink()
        shutil.copyfile(kept, camp)
    assert res.returncode == 0, res.stdout + res.stderr
    said = " ".join(res.stdout.split())
    assert "not packed:" in said and "campaign.json is a symbolic link" in said, res.stdout
    with tarfile.open(out) as tar:
        members = tar.getmembers()
        data = b"".join(tar.extractfile(m).read() for m in members if m.isfile())  # type: ignore[union-attr]
        readme = tar.extractfile(f"{r['run_id']}/README.md").read().decode()  # type: ignore[union-attr]
    assert b"outside the campaign folder" not in data and not any(m.issym() or m.islnk() for m in members)
    assert "## Left out" in readme and "campaign.json" in readme.split("## Left out")[1]


@pytest.mark.process
def test_ledger_exports_csv_and_mlflow(campaign, tmp_path):
    res = pilotrun_cli("ledger", "--csv", "--run", campaign["id"], "--ledger", str(campaign["ledger"]), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    runs = [r for r in rows if r["kind"] == "campaign-run"]
    assert len(runs) >= 6 and rows[0]["run_id"] == campaign["id"]
    diverged = [r for r in runs if r["status"] == "diverged"]
    assert len(diverged) >= 2 and all("first loss" in r["stop_reason"] and int(r["stopped_at"]) >= 1 for r in diverged)
    assert all(float(r["final_val_loss"]) > 0 for r in runs if r["status"] == "finished")
    out = tmp_path / "metrics.csv"
    res = pilotrun_cli("ledger", "--csv", "metrics", "--run", campaign["id"], "--out", str(out),
                       "--ledger", str(campaign["ledger"]), cwd=tmp_path)
    assert res.returncode == 0
    n = ledger_rows(campaign["ledger"], "SELECT COUNT(*) AS n FROM metrics WHERE run_id LIKE ?",
                    campaign["id"] + "-r%")[0]["n"]
    assert len(list(csv.DictReader(out.open()))) == n

    require("mlflow", "mlflow-skinny")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for _ in range(2):  # the second export finds every run already there
        res = pilotrun_cli("ledger", "--mlflow", uri, "--run", campaign["id"], "--ledger", str(campaign["ledger"]),
                           cwd=tmp_path, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(campaign["id"])
    found = {r.data.tags["pilotrun.run_id"]: r for r in client.search_runs([exp.experiment_id])}
    assert len(found) == len(rows)  # no duplicates after two exports
    for row in runs:
        mr = found[row["run_id"]]
        assert mr.info.status == ("FAILED" if row["status"] == "diverged" else "FINISHED")
        assert mr.data.tags["mlflow.parentRunId"] == found[campaign["id"]].info.run_id
        history = client.get_metric_history(mr.info.run_id, "train/loss")
        assert len(history) == (int(row["stopped_at"]) if row["status"] == "diverged" else 12)
    assert found[diverged[0]["run_id"]].data.tags["pilotrun.stop_reason"] == diverged[0]["stop_reason"]


def _small(tmp_path, **over):
    """Two lrs of the toy job, for the tests about how runs are started, stopped and recorded (not what they learn):
    its workers start without importing transformers (~3 s each on 2 cores) and train in milliseconds."""
    shutil.copytree(FIXTURES / "toy", tmp_path / "toy")
    body = {"name": "sweep", "base": "toy/pilot.yaml", "vary": {"train.optimizer.lr": LRS[:2]}, "seeds": [1],
            "updates": 2, "eval": {"every": 2}, "stop": {"non_finite": True, "divergence": DIVERGENCE,
                                                          "budget_minutes": 20},
            "keep": {"checkpoint": False, "export": False, "control_set": 0}, **over}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


@pytest.mark.process
def test_a_drifted_lock_is_refused_unless_flagged_and_then_kept_out_of_the_comparison(tmp_path, monkeypatch):
    from pilotrun.campaign import orchestrate

    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    real = orchestrate.collect_lock

    def drifting(spec):  # the variant's environment moved (another torch) between runs
        lock = real(spec)
        if spec.train.optimizer.lr == LRS[1]:
            lock["versions"]["torch"] = "2.99.0"
        return lock

    monkeypatch.setattr(orchestrate, "collect_lock", drifting)
    path, ledger = _small(tmp_path), tmp_path / "l.sqlite"
    res = orchestrate.run_campaign(path, ledger, tmp_path / "runs")
    assert [r["status"] for r in res["runs"]] == ["finished", "refused"]
    reason = res["runs"][1]["meta"]["stop_reason"]
    assert "versions.torch" in reason and "--allow-drift" in reason
    res = orchestrate.run_campaign(path, ledger, tmp_path / "runs", allow_drift=True)
    assert [r["status"] for r in res["runs"]] == ["finished", "finished"]
    assert res["runs"][1]["meta"]["lock_drift"] == ["versions.torch"]
    variant = res["conclusion"]["variants"][1]
    assert variant["finished"] == 0 and variant["val_loss_mean"] is None  # run, flagged, not compared
    assert any("drifted lock" in line for line in res["conclusion"]["text"])


@pytest.mark.process
def test_a_spent_budget_leaves_every_run_recorded_with_the_reason(tmp_path, monkeypatch):
    from pilotrun.campaign.orchestrate import run_campaign

    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    path = _small(tmp_path, updates=20000, stop={"budget_minutes": 0.0005})
    res = run_campaign(path, tmp_path / "l.sqlite", tmp_path / "runs")
    assert len(res["runs"]) == 2
    for r in res["runs"]:
        assert r["status"] in ("not-run", "stopped") and r["meta"]["stop_reason"].startswith("budget"), r


@pytest.mark.process
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_stops_the_runs_where_they_are_and_records_every_one(tmp_path, how):
    """ctrl-c: SIGINT to the whole group, as a terminal does. sigterm: what `timeout` or a scheduler sends, to
    pilotrun alone, started with SIGINT ignored (as a script's background job is)."""
    import os
    import signal
    import time

    path, ledger = _small(tmp_path, seeds=[1, 2], updates=20000, eval={"every": 5}), tmp_path / "l.sqlite"
    env = {**os.environ, "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST, "COLUMNS": "200"}
    ignore_int = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if how == "sigterm" else None
    proc = subprocess.Popen([sys.executable, "-m", "pilotrun", "campaign", str(path), "--parallel", "2", "--ledger",
                             str(ledger), "--out", str(tmp_path / "runs")], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=ignore_int)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # both runs are training: their first points are in the ledger
            time.sleep(0.5)
            if len(polled_rows(ledger, "SELECT DISTINCT run_id FROM metrics")) == 2:
                break
        else:
            pytest.fail("the runs never wrote a point")
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        else:
            os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # 128 + the signal, as a shell reports it: 130 after Ctrl-C, 143 after SIGTERM; the message names it.
    assert proc.returncode == (130 if how == "ctrl-c" else 143), out + err
    cause = f"interrupted ({'Ctrl-C' if how == 'ctrl-c' else 'SIGTERM'})"
    assert cause in err
    assert "every run is recorded" in err and "Traceback" not in err, out + err
    camp = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign'")[0]
    assert camp["status"] == "interrupted" and camp["ended_at"]
    runs = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign-run' ORDER BY run_id")
    assert [r["status"] for r in runs] == ["stopped", "stopped", "not-run", "not-run"], runs
    for r in runs[:2]:  # stopped where it was, every update before that kept once
        meta = json.loads(r["meta_json"])
        assert meta["stop_reason"] == cause and 5 <= meta["stopped_at"] < 20000  # a preemption is not a Ctrl-C
        steps = [m["step"] for m in ledger_rows(ledger, "SELECT step FROM metrics WHERE run_id = ? AND gate = 'train' "
                                                    "ORDER BY step", r["run_id"])]
        assert steps == list(range(1, meta["stopped_at"] + 1))
    for r in runs[2:]:
        assert "interrupted before this run started" in json.loads(r["meta_json"])["stop_reason"]
    conclusion = json.loads(camp["meta_json"])["conclusion"]["text"]
    assert conclusion[0] == "the campaign was interrupted: 0 run(s) finished, 2 stopped where they were, 2 not run"
    assert conclusion[1].startswith("the control (train.optimizer.lr = 0.003) has no finished run")
    res = pilotrun_cli("report", camp["run_id"], "--ledger", str(ledger), "--out", str(tmp_path / "r.html"),
                       cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    page = (tmp_path / "r.html").read_text()
    assert "· interrupted ·" in page and conclusion[0] in page and page.count(cause) == 2


@pytest.mark.process
def test_an_interrupted_campaign_resumes_its_cut_short_runs_as_new_linked_runs(tmp_path, monkeypatch):
    import shutil

    from pilotrun.campaign.orchestrate import CampaignInterrupted, run_campaign

    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    path, ledger = _small(tmp_path, seeds=[1, 2]), tmp_path / "l.sqlite"

    def interrupt_after_the_first_run(run):
        raise KeyboardInterrupt  # as a Ctrl-C between two runs

    with pytest.raises(CampaignInterrupted) as info:
        run_campaign(path, ledger, tmp_path / "runs", on_event=interrupt_after_the_first_run)
    cid = info.value.result["campaign_id"]
    assert [r["status"] for r in info.value.result["runs"]] == ["finished", "not-run", "not-run", "not-run"]

    spent = tmp_path / "spent.sqlite"  # the same campaign with its 20-minute budget used up
    shutil.copy(ledger, spent)
    meta = json.loads(ledger_rows(spent, "SELECT meta_json FROM runs WHERE run_id = ?", cid)[0]["meta_json"])
    con = sqlite3.connect(spent)
    with con:
        con.execute("UPDATE runs SET meta_json = ? WHERE run_id = ?", (json.dumps({**meta, "budget_spent_s": 1300}), cid))
    con.close()
    res = pilotrun_cli("campaign", cid, "--resume", "--ledger", str(spent), cwd=tmp_path)
    assert res.returncode == 2 and "has spent its budget (21.7 of 20 minutes)" in res.stderr, res.stderr

    path.write_text(path.read_text().replace("0.003", "0.5"))  # an edit after the start must not leak in
    res = pilotrun_cli("campaign", cid, "--resume", "--parallel", "2", "--ledger", str(ledger), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign-run' ORDER BY run_id")
    assert [(r["run_id"][-3:], r["status"], (r["parent_id"] or "")[-3:]) for r in runs] == [
        ("r01", "finished", ""), ("r02", "not-run", ""), ("r03", "not-run", ""), ("r04", "not-run", ""),
        ("r05", "finished", "r02"), ("r06", "finished", "r03"), ("r07", "finished", "r04")]
    for old, new in zip(runs[1:4], runs[4:]):
        old_meta, new_meta = json.loads(old["meta_json"]), json.loads(new["meta_json"])
        assert new_meta["continues"] == old["run_id"] and "retry_of" not in new_meta
        assert (new_meta["variant"], new_meta["seed"]) == (old_meta["variant"], old_meta["seed"])
        assert new["config_hash"] == old["config_hash"]  # the stored declaration, not the edited file
    camp = ledger_rows(ledger, "SELECT * FROM runs WHERE run_id = ?", cid)[0]
    assert camp["status"] == "finished"
    cmeta = json.loads(camp["meta_json"])
    text = cmeta["conclusion"]["text"]
    assert not any("interrupted" in line or "stopped or not run" in line for line in text), text
    assert [v["finished"] for v in cmeta["conclusion"]["variants"]] == [2, 2]
    assert cmeta["budget_spent_s"] > 0
    assert any("conclusion after resume (3 run(s) continued)" in n["text"]
               for n in ledger_rows(ledger, "SELECT text FROM notes WHERE run_id = ?", cid))

    res = pilotrun_cli("campaign", cid, "--resume", "--ledger", str(ledger), cwd=tmp_path)
    assert res.returncode == 2 and "was not interrupted (it ended finished)" in res.stderr
    res = pilotrun_cli("campaign", cid, "--ledger", str(ledger), cwd=tmp_path)
    assert res.returncode == 2 and "give --resume" in res.stderr


@pytest.mark.process
def test_a_killed_campaign_is_found_by_resume_and_every_open_run_gets_an_end(tmp_path):
    """SIGKILL (the OOM killer, a reboot) leaves no end: --resume tells a live campaign from a dead one."""
    import os
    import signal
    import time

    path, ledger = _small(tmp_path, seeds=[1, 2], updates=20000, eval={"every": 200}), tmp_path / "l.sqlite"
    env = {**os.environ, "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST, "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "pilotrun", "campaign", str(path), "--parallel", "2", "--ledger",
                             str(ledger), "--out", str(tmp_path / "runs")], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not polled_rows(ledger, "SELECT run_id FROM runs WHERE kind = 'campaign'"):
            time.sleep(0.3)
        cid = ledger_rows(ledger, "SELECT run_id FROM runs WHERE kind = 'campaign'")[0]["run_id"]
        res = pilotrun_cli("campaign", cid, "--resume", "--ledger", str(ledger), cwd=tmp_path)
        assert res.returncode == 2 and f"is still running (pid {proc.pid})" in res.stderr, res.stderr
        while time.monotonic() < deadline:  # both runs are training
            time.sleep(0.3)
            if len(polled_rows(ledger, "SELECT DISTINCT run_id FROM metrics WHERE gate = 'train'")) == 2:
                break
        else:
            pytest.fail("the runs never wrote a point")
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert workers, "the campaign started no worker"
        # The campaign alone, as the OOM killer picks one process: no chance to record anything, and its workers
        # (each under a keeper in a session of its own) must go with it, not train on unseen.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(workers, timeout=20)
        assert not alive, f"the SIGKILLed campaign left {[p.cmdline()[-8:] for p in alive]} running"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert ledger_rows(ledger, "SELECT status FROM runs WHERE run_id = ?", cid)[0]["status"] == "running"
    # An hour-old start: the recovery happens, then the budget check stops the resume before any run starts.
    con = sqlite3.connect(ledger)
    with con:
        con.execute("UPDATE runs SET started_at = '2026-01-01T00:00:00.000+00:00' WHERE run_id = ?", (cid,))
    con.close()
    res = pilotrun_cli("campaign", cid, "--resume", "--ledger", str(ledger), cwd=tmp_path)
    assert res.returncode == 2 and "has spent its budget" in res.stderr, res.stderr
    runs = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign-run' ORDER BY run_id")
    assert [r["status"] for r in runs] == ["stopped", "stopped", "not-run", "not-run"]
    for r in runs[:2]:
        meta = json.loads(r["meta_json"])
        last = ledger_rows(ledger, "SELECT MAX(step) AS s FROM metrics WHERE run_id = ? AND gate = 'train'",
                           r["run_id"])
        assert meta["stopped_at"] == last[0]["s"] >= 1 and meta["stop_reason"] == (
            f"the campaign's process (pid {proc.pid}) was killed; the last update this run recorded is {last[0]['s']}")
    assert "killed before this run started" in json.loads(runs[2]["meta_json"])["stop_reason"]
    camp = ledger_rows(ledger, "SELECT * FROM runs WHERE run_id = ?", cid)[0]
    assert camp["status"] == "interrupted" and camp["ended_at"]
    assert json.loads(camp["meta_json"])["conclusion"]["text"][0].startswith("the campaign was interrupted")
