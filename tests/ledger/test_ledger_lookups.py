"""The lookups a restart makes — the runs a task started (``--task-id``), a campaign's runs, a spec's runs by config
hash — are indexed queries on a real SQLite file: a task finds its pilot and its campaign behind thousands of newer
rows of the same name, an existing ledger gets the indexes when it is next opened, and a row whose meta is not JSON
breaks neither the index nor later writes."""
from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import yaml

from pilotrun.campaign.followup import task_campaign
from pilotrun.campaign.orchestrate import finish
from pilotrun.config.load import load_spec
from pilotrun.ledger.records import RunKind, RunStatus
from pilotrun.ledger.store import Ledger
from pilotrun.pilot.recovery import Recovery, pilot_recovery
from tests.conftest import FIXTURES, pilotrun_cli

NEW_INDEXES = ("runs_name_kind", "runs_task", "runs_campaign", "runs_config", "runs_parent")
CID = "toy-20261201-000000-abcd"
NEWER = 1200  # newer rows of the same name than the task's own: more than any window of recent rows looked at


def _crowded_ledger(tmp_path: Path) -> tuple[Path, Path, str]:
    """The toy spec and a ledger where task t-1 ran its pilot (passed) and its campaign (finished, its runs named
    after the base, as a campaign's runs are), followed by another task's pilots and NEWER runs of that name."""
    shutil.copytree(FIXTURES / "toy", tmp_path / "toy")
    spec_path = tmp_path / "toy" / "pilot.yaml"
    spec = load_spec(spec_path)
    ledger = tmp_path / "l.sqlite"
    with Ledger(ledger) as led:
        led.start_run("toy-pilot-t1", spec.name, RunKind.PILOT, config_hash=spec.config_hash(), meta={"task_id": "t-1"})
        led.end_run("toy-pilot-t1", RunStatus.PASS)
        led.start_run(CID, spec.name, RunKind.CAMPAIGN, config_hash="c", meta={
            "task_id": "t-1", "key": "train.optimizer.lr", "values": [0.01], "seeds": [1]})
        led.start_run("toy-pilot-t0", spec.name, RunKind.PILOT, config_hash=spec.config_hash(), meta={"task_id": "t-0"})
        led.plan_runs({"run_id": f"{CID}-r{i:04d}", "name": spec.name, "kind": RunKind.CAMPAIGN_RUN,
                       "meta": {"campaign_id": CID, "variant": 0.01, "variant_index": 0, "seed": i, "control": True}}
                      for i in range(1, NEWER + 1))
        for i in range(1, NEWER + 1):  # every run has its result: the campaign has nothing left to run
            led.set_status(f"{CID}-r{i:04d}", RunStatus.FINISHED)
        # What the old lookup read: the newest 500 rows of the name hold neither of t-1's runs.
        newest = [r["run_id"] for r in led.runs(spec.name, limit=500)]
        assert "toy-pilot-t1" not in newest and CID not in newest
    finish(CID, ledger)  # the campaign's end and conclusion, as it records them
    return spec_path, ledger, spec.config_hash()


def test_a_task_finds_its_pilot_and_its_campaign_behind_thousands_of_newer_rows_of_its_name(tmp_path):
    _, ledger, config_hash = _crowded_ledger(tmp_path)
    with Ledger(ledger) as led:
        assert [r["run_id"] for r in led.task_runs("toy", RunKind.PILOT, "t-1")] == ["toy-pilot-t1"]
        assert [r["run_id"] for r in led.task_runs("toy", RunKind.PILOT, "t-0")] == ["toy-pilot-t0"]
        assert led.task_runs("toy", RunKind.PILOT, "t-9") == []
        plan = pilot_recovery(led.task_runs("toy", RunKind.PILOT, "t-1"), "t-1", config_hash)
        assert (plan.action, plan.run_id) == (Recovery.PROVEN, "toy-pilot-t1"), plan.reason
        camp = task_campaign(led, "toy", "t-1")
        assert camp is not None and camp["run_id"] == CID
        assert task_campaign(led, "toy", "t-0") is None  # t-0 ran a pilot, no campaign
        assert len(led.campaign_runs(CID)) == NEWER
        assert led.runs("toy", limit=5, kind=RunKind.PILOT)[0]["run_id"] == "toy-pilot-t0"  # newest pilot first


@pytest.mark.process
def test_the_restarted_tasks_commands_find_their_runs_and_run_nothing_again(tmp_path):
    spec_path, ledger, _ = _crowded_ledger(tmp_path)
    res = pilotrun_cli("run", str(spec_path), "--task-id", "t-1", "--ledger", str(ledger), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "task t-1's pilot toy-pilot-t1 ended pass: not run again" in " ".join((res.stdout + res.stderr).split())
    sweep = tmp_path / "toy.yaml"  # named after the base, as the crowded rows are
    sweep.write_text(yaml.safe_dump({"name": "toy", "base": "toy/pilot.yaml", "vary": {"train.optimizer.lr": [0.01, 0.02]},
                                     "seeds": [1], "updates": 2}))
    res = pilotrun_cli("campaign", str(sweep), "--task-id", "t-1", "--ledger", str(ledger), "--out",
                       str(tmp_path / "runs"), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"task t-1's campaign {CID} has ended" in " ".join((res.stdout + res.stderr).split())
    with Ledger(ledger) as led:  # no second campaign, no second pilot
        assert [r["run_id"] for r in led.runs("toy", limit=10, kind=RunKind.CAMPAIGN)] == [CID]
        assert len(led.runs("toy", limit=10, kind=RunKind.PILOT)) == 2


def _plans(led: Ledger, calls) -> list[str]:
    """The query plan SQLite chose for each statement the calls ran (the statements as traced, values bound)."""
    statements: list[str] = []
    led.conn.set_trace_callback(statements.append)
    try:
        calls()
    finally:
        led.conn.set_trace_callback(None)
    return [" | ".join(row[3] for row in led.conn.execute("EXPLAIN QUERY PLAN " + s)) for s in statements]


def test_the_restart_lookups_are_indexed_queries(tmp_path):
    _, ledger, config_hash = _crowded_ledger(tmp_path)
    with Ledger(ledger) as led:
        for calls, index in ((lambda: led.task_runs("toy", RunKind.CAMPAIGN, "t-1"), "runs_task"),
                             (lambda: led.campaign_runs(CID), "runs_campaign"),
                             (lambda: led.run_ids(RunKind.PILOT, config_hash), "runs_config"),
                             (lambda: led.children(CID), "runs_parent"),
                             (lambda: led.runs("toy", limit=3, kind=RunKind.PILOT), "runs_name_kind")):
            (plan,) = _plans(led, calls)
            assert f"INDEX {index}" in plan and "SCAN runs" not in plan, plan


def test_an_existing_ledger_gets_the_indexes_and_a_row_whose_meta_is_not_json_breaks_nothing(tmp_path):
    path = tmp_path / "old.sqlite"
    with Ledger(path) as led:
        led.start_run("p-old", "toy", RunKind.PILOT, meta={"task_id": "t-1"})
    with sqlite3.connect(path) as conn:  # the file as the previous release left it: none of the new indexes
        for name in NEW_INDEXES:
            conn.execute(f"DROP INDEX {name}")
        # A hand-edited row: json_extract alone would fail building the index and every later write.
        conn.execute("INSERT INTO runs (run_id, name, kind, status, started_at, meta_json) VALUES "
                     "('p-bad', 'toy', 'pilot', 'pass', '2026-01-01T00:00:00', '{not json')")
        assert not conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'runs_task'").fetchall()
    with Ledger(path) as led:
        led.start_run("p-new", "toy", RunKind.PILOT, meta={"task_id": "t-1"})
        assert [r["run_id"] for r in led.task_runs("toy", RunKind.PILOT, "t-1")] == ["p-new", "p-old"]
        assert {r["run_id"] for r in led.runs("toy", limit=10)} == {"p-old", "p-bad", "p-new"}
    with sqlite3.connect(path) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert set(NEW_INDEXES) <= names
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        meta = conn.execute("SELECT meta_json FROM runs WHERE run_id = 'p-new'").fetchone()[0]
    assert json.loads(meta) == {"task_id": "t-1"}
