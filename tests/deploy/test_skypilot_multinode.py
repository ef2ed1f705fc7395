"""A plan over several nodes as a SkyPilot task: ``num_nodes`` and the accelerators per node (SkyPilot's own parser
reads such a task in tests/deploy/test_skypilot.py), and its run script as SkyPilot runs it on every node: here two "nodes"
on loopback (two bash processes, SKYPILOT_NODE_IPS, SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES and
SKYPILOT_NUM_GPUS_PER_NODE set as SkyPilot sets them; gloo on CPU, one process a node), then restarted as a managed
job's recovery restarts them. And a plan that changes the spec, with a campaign: the task carries the changed spec."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pilotrun.deploy.skypilot import CampaignPart, TaskRefused, task_text
from tests.conftest import FIXTURES, TEST_DIGEST, ledger_rows
from tests.deploy.test_deploy import inputs

TWO_NODES = {"gpus": 16, "gpus_per_node": 8}


def test_a_plan_over_two_nodes_is_a_task_of_two_nodes_whose_every_node_starts_torchrun_at_node_0():
    text = task_text(inputs(row=inputs().row | TWO_NODES, campaign=None))
    task = yaml.safe_load(text)
    assert task["num_nodes"] == 2 and task["resources"]["accelerators"] == "H100:8"
    assert "# the plan's 16 GPUs as 2 nodes x 8 (8 per node" in text
    run = task["run"]
    assert 'HEAD="$(echo "${SKYPILOT_NODE_IPS:?' in run and 'RDZV="$HEAD:${PILOTRUN_RDZV_PORT:-29500}"' in run
    launch = run.index('-m pilotrun launch --nnodes "$NNODES" --node-rank "$NODE" --rdzv-endpoint "$RDZV" '
                       '--nproc-per-node "$PER_NODE" "$WORKDIR/job/pilot.yaml" --set distributed.strategy=fsdp '
                       '--task-id "$TASK" --proven-lock "$PILOTRUN_PROVEN_LOCK"')
    # only node 0 goes to the bucket; another node's ledger is its own, from a copy of the bucket's
    assert run.index('if [ "$NODE" = 0 ]; then') < run.index('cd "$PILOTRUN_BUCKET"') < launch
    assert 'export PILOTRUN_LEDGER="$LEDGER"' in run and task["envs"]["PILOTRUN_RDZV_PORT"] == 29500
    one = yaml.safe_load(task_text(inputs(campaign=None)))  # one node: the script as it was, no node setup
    assert one["num_nodes"] == 1 and "SKYPILOT_NODE_RANK" not in one["run"] and "PILOTRUN_RDZV_PORT" not in one["envs"]
    # the campaign: every node runs it, node 0 leads and the others follow; the long run too, on every node
    both = yaml.safe_load(task_text(inputs(row=inputs().row | TWO_NODES, long_run="torchrun --nnodes $NNODES x.py")))
    assert ('-m pilotrun campaign "$WORKDIR/job/sweep.yaml" --task-id "$TASK" --nnodes "$NNODES" --node-rank "$NODE" '
            '--rdzv-endpoint "$RDZV" --nproc-per-node "$PER_NODE"') in both["run"]
    assert both["run"].index("pilotrun launch") < both["run"].index("pilotrun campaign") < both["run"].index(
        "torchrun --nnodes $NNODES x.py")
    assert "It runs on every node: start your launcher with --nnodes" in both["run"]
    with pytest.raises(TaskRefused, match="over 2 nodes, and --campaign job/sweep.yaml runs your program"):
        task_text(inputs(row=inputs().row | TWO_NODES, campaign=CampaignPart("job/sweep.yaml", 3, 16, True, False,
                                                                             over_nodes=False)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_node_task(tmp_path: Path, monkeypatch) -> tuple[Path, Path, str]:
    """The toy job with a 2-run campaign, its lock (this machine's), and the run script of a plan of ddp over 2 nodes
    x 1 GPU that pilots the cluster and then runs the campaign on it."""
    from pilotrun.config.load import load_spec
    from pilotrun.lock import collect_lock

    work = tmp_path / "toy"
    shutil.copytree(FIXTURES / "toy", work, ignore=shutil.ignore_patterns("__pycache__"))
    spec_file = work / "pilot.yaml"
    body = yaml.safe_load(spec_file.read_text())
    body["pilot"] = {**body.get("pilot", {}), "gates": ["lock", "load"]}  # as short as the loopback launch test
    body["distributed"] = {"strategy": "ddp"}  # the plan's strategy, written in the spec (as pilot.planned.yaml is)
    spec_file.write_text(yaml.safe_dump(body, sort_keys=False))
    (work / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "sweep", "base": "pilot.yaml", "vary": {"train.optimizer.lr": [3.0e-3, 1.0e-3]}, "seeds": [1],
        "updates": 4, "eval": {"every": 2}, "stop": {"non_finite": True, "divergence": 50.0, "budget_minutes": 20},
        "keep": {"checkpoint": False, "export": False, "control_set": 0}}, sort_keys=False))
    lock_file = tmp_path / "task.lock.json"
    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)  # as the nodes get it: the same container
    lock_file.write_text(json.dumps(collect_lock(load_spec(spec_file))))
    row = inputs().row | {"gpus": 2, "gpus_per_node": 1, "strategy": "ddp", "activation_checkpointing": False,
                          "micro_batch_size": 4, "grad_accum_steps": 1}
    task = yaml.safe_load(task_text(inputs(row=row, campaign=CampaignPart("sweep.yaml", 2, 1, False, False),
                                           spec_rel="pilot.yaml", overrides=[])))
    assert task["num_nodes"] == 2
    return work, lock_file, task["run"]


def _start_nodes(tmp_path: Path, work: Path, lock_file: Path, run: str) -> list[tuple[int, str]]:
    """The run script on two loopback nodes at once; each node's (exit code, output)."""
    port = _free_port()
    bucket = tmp_path / "bucket"
    env = {**os.environ, "PILOTRUN_BUCKET": str(bucket), "PILOTRUN_LEDGER": str(bucket / "ledger.sqlite"),
           "PILOTRUN_PROVEN_LOCK": str(lock_file), "PILOTRUN_PYTHON": sys.executable,
           "SKYPILOT_TASK_ID": "sky-managed-2026-12-04-0001_pilotrun-toy_1-0", "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST,
           "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "1",
           "PILOTRUN_RDZV_PORT": str(port), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(["bash", "-c", run], cwd=work, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env={**env, "SKYPILOT_NODE_RANK": str(rank),
                                   "PILOTRUN_NODE_DIR": str(tmp_path / f"node{rank}-local")})
             for rank in (0, 1)]
    out = []
    try:
        for p in procs:
            out.append((p.wait(timeout=240), p.stdout.read() if p.stdout else ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.process
def test_the_run_script_pilots_the_whole_cluster_then_runs_the_campaign_over_it_and_a_restart_decides_the_same(tmp_path,
                                                                                                      monkeypatch):
    work, lock_file, run = _two_node_task(tmp_path, monkeypatch)
    first = _start_nodes(tmp_path, work, lock_file, run)
    for code, out in first:
        assert code == 0, out
    bucket = tmp_path / "bucket"
    pilots = ledger_rows(bucket / "ledger.sqlite", "SELECT run_id, status FROM runs WHERE kind = 'pilot'")
    rows = ledger_rows(bucket / "ledger.sqlite", "SELECT gate, rank, world_size, verdict, reason FROM gate_rows")
    assert [p["status"] for p in pilots] == ["pass"], [r["reason"] for r in rows if r["verdict"] != "pass"]
    run_id = pilots[0]["run_id"]
    assert {r["world_size"] for r in rows} == {2} and {r["verdict"] for r in rows} <= {"pass", "warn"}
    assert {r["gate"] for r in rows} == {"lock", "load"}
    # node 1 wrote nothing on the bucket: its ranks' rows are in its own ledger, its run folder on its own disk
    local = tmp_path / "node1-local"
    assert (local / "ledger.sqlite").exists() and (local / "runs" / run_id).is_dir()
    assert sorted(p.name for p in bucket.iterdir() if not p.name.startswith("ledger.sqlite")) == ["runs"]
    node1_rows = ledger_rows(local / "ledger.sqlite", "SELECT rank FROM gate_rows WHERE run_id = ?", run_id)
    assert {r["rank"] for r in rows} | {r["rank"] for r in node1_rows} == {0, 1}
    # the campaign, once the pilot passed: both runs over the two nodes, one at a time; node 0 wrote every rank's
    # points (node 1's came through the campaign's store), and node 1 follows until node 0 ends
    runs = ledger_rows(bucket / "ledger.sqlite", "SELECT run_id, status FROM runs WHERE kind = 'campaign-run'")
    assert [r["status"] for r in runs] == ["finished", "finished"], first[0][1]
    points = ledger_rows(bucket / "ledger.sqlite", "SELECT run_id, gate, rank, count(*) AS n FROM metrics WHERE "
                         "gate IN ('train', 'val') GROUP BY run_id, gate, rank")
    assert {(p["gate"], p["rank"], p["n"]) for p in points} == {("train", 0, 4), ("train", 1, 4), ("val", 0, 2)}
    assert {p["run_id"] for p in points} == {r["run_id"] for r in runs}
    assert "follows node 0" in first[1][1] and "task sky-managed" in first[0][1]
    assert not ledger_rows(local / "ledger.sqlite", "SELECT run_id FROM runs WHERE kind LIKE 'campaign%'")

    again = _start_nodes(tmp_path, work, lock_file, run)  # a recovery: every node runs the script again
    for code, out in again:
        assert code == 0 and "not run again" in out, out
    assert "has ended (finished): nothing to run" in again[0][1]
    assert len(ledger_rows(bucket / "ledger.sqlite", "SELECT run_id FROM runs")) == 4  # the pilot, the campaign, 2 runs


@pytest.mark.process
def test_a_plan_that_changes_the_spec_writes_it_beside_the_campaign_and_the_task_runs_it(tmp_path):
    from pilotrun.campaign.spec import load_campaign
    from pilotrun.config.load import load_spec
    from tests.conftest import pilotrun_cli
    from tests.deploy.test_skypilot import _toy_job

    spec, campaign = _toy_job(tmp_path)
    body = yaml.safe_load(spec.read_text())
    spec.write_text(yaml.safe_dump(body | {"distributed": {"strategy": "ddp"}}, sort_keys=False))  # the plan: single
    task_file = tmp_path / "task.yaml"
    res = pilotrun_cli("plan", str(spec), "--accelerator", "L4-24GB", "--skypilot", str(task_file), "--campaign",
                       str(campaign), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    planned_spec, planned_campaign = spec.with_name("pilot.planned.yaml"), campaign.with_name("sweep.planned.yaml")
    assert load_spec(planned_spec).distributed.strategy == "single"  # the plan's key, written; nothing copied by hand
    c = load_campaign(planned_campaign)
    assert (c.folder / c.base).resolve() == planned_spec.resolve() and c.vary == {"train.optimizer.lr": [3.0e-3, 1.0e-3]}
    text = task_file.read_text()
    run = yaml.safe_load(text)["run"]
    assert '-m pilotrun run "$WORKDIR/pilot.planned.yaml" --task-id "$TASK"' in run and "--set" not in run
    assert '-m pilotrun campaign "$WORKDIR/sweep.planned.yaml" --task-id "$TASK"' in run
    assert "# The plan changes the spec (distributed.strategy: single): written as pilot.planned.yaml" in text
    assert hashlib.sha256(spec.read_bytes()).hexdigest() in planned_spec.read_text()  # which source it was made of
