"""The ledger is a real SQLite file: rows survive, concurrent writers lose nothing, a kill leaves whole rows."""
from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import pytest

from pilotrun.ledger import Ledger, LedgerError
from pilotrun.ledger.details import ExportDetails, LoadDetails, OverfitDetails, SaveDetails, SteadyStepDetails
from pilotrun.ledger.records import RunKind
from tests.conftest import pilotrun_cli, require

WRITER = textwrap.dedent("""
    import sys
    from pilotrun.ledger import Ledger
    path, run_id, n, per = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    led = Ledger(path)
    led.start_run(run_id, "w", "pilot")
    for i in range(n):
        row = {"gate": f"g{i}", "verdict": "pass", "reason": "ok", "inputs": {"i": i}, "memory": {}, "seconds": 0.1}
        led.add_gate_row(run_id, row, [{"step": s, "loss": 1.0, "sample_ids": ["a"] * 50} for s in range(per)])
        if i == 0:
            print("started", flush=True)
    led.end_run(run_id, "pass")
""")


def test_rows_persist_and_read_back(tmp_path):
    path = tmp_path / "l.sqlite"
    with Ledger(path) as led:
        led.start_run("r1", "job", "pilot", config_hash="abc", lock={"x": 1})
        led.add_gate_row("r1", {"gate": "load", "verdict": "warn", "reason": "why", "inputs": {"seq_len": 8},
                                "memory": {"peak_allocated_bytes": 5}, "seconds": 1.5},
                         [{"step": 1, "loss": 2.0, "lr": 0.1, "sample_ids": ["a", "b"]}])
        led.add_note("r1", "chose bf16")
        led.end_run("r1", "warn")
    with Ledger(path) as led:  # a new connection, as a later process would open
        run = led.run("r")  # unique prefix
        assert run["status"] == "warn" and run["ended_at"]
        (row,) = led.gate_rows("r1")
        assert row["inputs"] == {"seq_len": 8} and row["memory"]["peak_allocated_bytes"] == 5
        assert led.metrics("r1")[0]["sample_ids"] == ["a", "b"]
        assert led.notes("r1")[0]["text"] == "chose bf16"
        assert led.previous_lock("job", "other") == ("r1", {"x": 1})


def test_has_run_takes_the_exact_id_only(tmp_path):
    path = tmp_path / "l.sqlite"
    with Ledger(path) as led:
        led.start_run("job-20261201-1200-ab12", "job", "pilot")
    with Ledger(path) as led:  # what another node's process finds in the file
        assert led.has_run("job-20261201-1200-ab12")
        assert not led.has_run("job-20261201")  # a prefix names a run for people (run()), not for registering one
        assert not led.has_run("other")


def test_run_ids_are_the_runs_of_one_kind_and_config_newest_first(tmp_path):
    path = tmp_path / "l.sqlite"
    with Ledger(path) as led:
        led.start_run("p1", "job", "pilot", config_hash="abc")
        led.start_run("c1", "job", "campaign-run", config_hash="abc")
        led.start_run("p2", "job", "pilot", config_hash="other")
        led.start_run("p3", "job", "pilot", config_hash="abc")
        led.start_run("p4", "job", "pilot", config_hash="abc")
    with Ledger(path) as led:
        assert led.run_ids(RunKind.PILOT, "abc") == ["p4", "p3", "p1"]
        assert led.run_ids("campaign-run", "abc") == ["c1"]
        assert led.run_ids(RunKind.PILOT, "missing") == []
        with pytest.raises(ValueError, match="'pilots' is not a valid RunKind"):
            led.run_ids("pilots", "abc")


def test_invalid_verdict_is_refused(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as led:
        led.start_run("r", "j", "pilot")
        with pytest.raises(ValueError, match="'great' is not a valid Verdict"):
            led.add_gate_row("r", {"gate": "x", "verdict": "great", "reason": "", "inputs": {}, "memory": {}})
        with pytest.raises(sqlite3.IntegrityError):  # and the schema's CHECK, for writers that bypass the type
            with led.transaction() as cur:
                cur.execute("INSERT INTO gate_rows (run_id, gate, verdict, reason, inputs_json, memory_json, started_at,"
                            " ended_at) VALUES ('r', 'x', 'great', '', '{}', '{}', '', '')")
        assert led.gate_rows("r") == []  # the failed transaction left nothing


def test_a_claim_moves_a_status_once(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as led, Ledger(tmp_path / "l.sqlite") as other:
        led.start_run("c", "j", "campaign")
        led.set_status("c", "interrupted")
        assert led.claim("c", "interrupted", "running", {"by": 1})
        assert not other.claim("c", "interrupted", "running", {"by": 2})  # a second resume finds it taken
        assert other.run("c")["status"] == "running" and json.loads(other.run("c")["meta_json"]) == {"by": 1}


def test_ambiguous_prefix_is_an_error(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as led:
        led.start_run("job-1", "j", "pilot")
        led.start_run("job-2", "j", "pilot")
        with pytest.raises(LedgerError, match="matches 2 runs"):
            led.run("job")


def test_a_campaign_prefix_means_the_campaign_not_its_runs(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as led:
        led.start_run("sweep-1", "sweep", "campaign")
        for k in (1, 2):
            led.start_run(f"sweep-1-r0{k}", "sweep", "campaign-run")
        assert led.run("sweep")["run_id"] == "sweep-1"
        assert led.run("sweep-1-r02")["run_id"] == "sweep-1-r02"
        led.start_run("sweep-2", "sweep", "campaign")  # two campaigns: the prefix is ambiguous again
        with pytest.raises(LedgerError, match=r"matches 2 runs \(sweep-2, sweep-1\)"):
            led.run("sweep")
        # What `pilotrun ledger --run` offers instead: every candidate, newest first, campaign runs folded in.
        assert [r["run_id"] for r in led.matches("sweep")] == ["sweep-2", "sweep-1"]
        assert [r["run_id"] for r in led.matches("sweep-1")] == ["sweep-1"]
        assert led.matches("nothing") == []


@pytest.mark.process
def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "l.sqlite"
    Ledger(path).close()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), f"r{k}", "40", "5"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    with Ledger(path) as led:
        for k in range(4):
            rows = led.gate_rows(f"r{k}")
            assert [r["gate"] for r in rows] == [f"g{i}" for i in range(40)]
            assert len(led.metrics(f"r{k}")) == 200
            assert led.run(f"r{k}")["status"] == "pass"


def _open_fresh(path, barrier, errors):
    barrier.wait()
    try:
        Ledger(path).close()
    except LedgerError as exc:
        errors.put(str(exc))


@pytest.mark.process
def test_processes_creating_the_same_new_ledger_at_once_all_open_it(tmp_path):
    # The ranks of a torchrun job open a new ledger at the same instant: switching the file to WAL used to
    # answer "database is locked" to one of two ranks about one time in ten (a CI failure of the FSDP test).
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    for round_ in range(15):
        barrier = ctx.Barrier(4)
        procs = [ctx.Process(target=_open_fresh, args=(tmp_path / f"l{round_}.sqlite", barrier, errors))
                 for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert found == []


@pytest.mark.process
def test_sigkill_mid_write_leaves_complete_rows_only(tmp_path):
    path = tmp_path / "l.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "victim", "100000", "40"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"started"
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()
    with Ledger(path) as led:
        rows = led.gate_rows("victim")
        assert 0 < len(rows) < 100000
        metrics = led.metrics("victim")
        assert len(metrics) == 40 * len(rows)  # every row came with all its metrics, or not at all
        run = led.run("victim")
        assert run["status"] == "running" and run["ended_at"] is None  # honest: no end was recorded


def test_an_mlflow_export_taken_mid_run_is_brought_up_to_date_not_duplicated(tmp_path):
    require("mlflow", "mlflow-skinny")
    from mlflow.tracking import MlflowClient

    from pilotrun.ledger.mlflow_export import export_runs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with Ledger(tmp_path / "l.sqlite") as led:
        led.start_run("job-1", "job", "pilot")
        train = {"gate": "train", "verdict": "pass", "reason": "3 point(s)", "inputs": {}, "memory": {}}
        led.add_gate_row("job-1", train, [{"step": s, "loss": 4.0 - s, "lr": 0.1} for s in (1, 2, 3)])
        (first,) = export_runs(led, [led.run("job-1")], uri)
        assert first["status"] == "RUNNING"
        led.add_gate_row("job-1", train, [{"step": s, "loss": 4.0 - s, "lr": 0.1} for s in (4, 5)])
        led.end_run("job-1", "fail")
        (second,) = export_runs(led, [led.run("job-1")], uri)
        assert second["mlflow_run_id"] == first["mlflow_run_id"]
        assert second["status"] == "updated: 4 new points, now FAILED"  # loss and lr at steps 4 and 5
        (third,) = export_runs(led, [led.run("job-1")], uri)
        assert third["status"] == "already exported"
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(first["mlflow_run_id"])
    assert run.info.status == "FAILED" and run.data.tags["pilotrun.status"] == "fail"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4, 5]


LONG_REASON = ("out of memory at length 4096, batch 8: " + "the optimizer state and the activations together " * 6
               + "END-OF-REASON")


def _pilot_with_a_long_reason(path, run_id: str) -> None:
    from pilotrun.ledger.records import GateRow

    with Ledger(path) as led:
        led.start_run(run_id, "tiny-sft", "pilot")
        led.add_gate_row(run_id, GateRow.now("eval", "fail", LONG_REASON, seconds=1.0))
        led.end_run(run_id, "fail")


@pytest.mark.process
def test_ledger_run_cuts_reasons_to_the_width_and_full_prints_them_whole(tmp_path):
    path = tmp_path / "l.sqlite"
    _pilot_with_a_long_reason(path, "tiny-sft-2026-a")
    for columns in ("100", "300"):  # COLUMNS sets the width without a terminal, as on one
        res = pilotrun_cli("ledger", "--ledger", str(path), "--run", "tiny-sft-2026-a", cwd=tmp_path,
                           env={"COLUMNS": columns})
        assert res.returncode == 0, res.stderr
        assert "END-OF-REASON" not in res.stdout and "…" in res.stdout
        assert max(len(line) for line in res.stdout.splitlines()) <= int(columns)
    res = pilotrun_cli("ledger", "--ledger", str(path), "--run", "tiny-sft-2026-a", "--full", cwd=tmp_path,
                       env={"COLUMNS": "100"})
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100 and "…" not in res.stdout
    assert " ".join("".join(line.split()) for line in lines).count("END-OF-REASON") == 1
    assert "".join(LONG_REASON.split()) in "".join(res.stdout.split())  # every word, in order, wrapped


@pytest.mark.process
def test_an_ambiguous_prefix_shows_the_newest_run_and_lists_the_others(tmp_path):
    path = tmp_path / "l.sqlite"
    for k in (1, 2, 3):
        _pilot_with_a_long_reason(path, f"tiny-sft-2026-{k}")
    res = pilotrun_cli("ledger", "--ledger", str(path), "--run", "tiny-sft-2026", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("run tiny-sft-2026-3 ")
    assert "'tiny-sft-2026' matches 3 runs; showing the newest, tiny-sft-2026-3" in res.stderr
    assert res.stderr.index("tiny-sft-2026-2") < res.stderr.index("tiny-sft-2026-1")
    res = pilotrun_cli("ledger", "--ledger", str(path), "--run", "tiny-sft-2026", "--json", cwd=tmp_path)
    out = json.loads(res.stdout)
    assert out["run"]["run_id"] == "tiny-sft-2026-3" and out["other_matches"] == ["tiny-sft-2026-2", "tiny-sft-2026-1"]
    res = pilotrun_cli("ledger", "--ledger", str(path), "--run", "tiny-sft-2026-1", cwd=tmp_path)
    assert res.stdout.startswith("run tiny-sft-2026-1 ") and res.stderr == ""
    res = pilotrun_cli("ledger", "--ledger", str(path), "--run", "other", cwd=tmp_path)
    assert res.returncode == 2 and "no run 'other'" in res.stderr


def test_row_details_write_the_keys_rows_have_always_had():
    """report.json keeps the order keys were written in; ledgers and reports written before must read the same."""
    assert list(LoadDetails.of({}).to_dict()) == [
        "model_class", "source", "head", "parameters", "trainable_parameters", "parameter_bytes", "parameter_dtypes",
        "device_choice", "loss_normalization", "data_sizes", "label_names", "notes", "updates_per_epoch", "strategy",
        "gradient_reduction", "examples_per_update", "optimizer", "precision"]
    assert list(SteadyStepDetails.of({}).to_dict()) == [
        "seconds_per_update", "median_seconds_per_update", "examples_per_second", "tokens_per_second",
        "data_wait_seconds_per_update", "data_wait_share", "memory_measured_on_update", "timed_updates", "losses",
        "timed_seq_len_max"]
    assert list(SaveDetails.of({}).to_dict()) == ["path", "bytes", "files", "step", "layout", "bytes_per_second",
                                                  "write_seconds", "manifest_sha256", "expect"]
    assert list(ExportDetails.of({}).to_dict()) == ["path", "files", "bytes", "tensors", "manifest_sha256"]
    assert list(OverfitDetails.of({}).to_dict()) == ["memory_note", "losses", "checks", "ids", "updates", "thresholds"]
    # Keys written in some cases only come with the field that says the case, after the others.
    adapter = replace(LoadDetails.of({}), trainable_bytes=4, base_identity="sha", restored_from="step-000004")
    assert list(adapter.to_dict())[-7:] == ["frozen_parameters", "trainable_bytes", "frozen_bytes", "trainable_share",
                                            "base_identity", "restored_from", "restored_step"]
    assert list(replace(ExportDetails.of({}), adapter=True).to_dict())[-4:] == ["adapter", "base_identity", "merged",
                                                                                 "merge_note"]
    assert SteadyStepDetails.of({"note": "one steady update"}).to_dict()["note"] == "one steady update"
    assert "stale_temps_removed" in replace(SaveDetails.of({}), stale_temps_removed=[]).to_dict()


def test_row_details_read_rows_written_before_and_by_programs(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as led:
        led.start_run("r", "job", "pilot")
        # An older steady_step row (no data wait yet), carried by --resume, and a program's row timing its stages.
        led.add_gate_row("r", {"gate": "steady_step", "verdict": "pass", "reason": "", "inputs": {}, "memory": {},
                               "details": {"seconds_per_update": 0.5, "carried_from": "r0", "warnings": ["w"]}})
        led.add_gate_row("r", {"gate": "steady_step", "verdict": "pass", "reason": "", "inputs": {}, "memory": {}})
        old, program = (SteadyStepDetails.of(r["details"]) for r in led.gate_rows("r"))
    assert (old.seconds_per_update, old.data_wait_share) == (0.5, None)
    assert program == SteadyStepDetails.of(None) and program.seconds_per_update is None
    assert SaveDetails.of({"path": "checkpoints/step-000008"}).manifest_sha256 is None  # a failed save's row


@pytest.mark.process
def test_a_csv_piped_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """`pilotrun ledger --csv metrics | head -1`: the reader closing the pipe is not an internal error."""
    path = tmp_path / "l.sqlite"
    with Ledger(path) as led:
        led.start_run("r", "job", "campaign-run")
        led.add_metrics("r", "train", [{"step": i, "loss": 1.0 / (i + 1), "lr": 0.1} for i in range(20000)])
    proc = subprocess.Popen([sys.executable, "-m", "pilotrun", "ledger", "--ledger", str(path), "--csv", "metrics"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"run_id,")
    proc.stdout.close()  # as head does after its line
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and b"internal error" not in err and b"Traceback" not in err, err
    assert not (tmp_path / "runs" / "pilotrun-crash.txt").exists()
