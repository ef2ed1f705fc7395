"""A campaign whose every run spans several nodes (engines/nodes.py): the cluster as flags, the plan it allows, and
the store between node 0 and the others, in one process (a real TCPStore on loopback). The whole path, two "nodes" of
real processes running a SkyPilot task's script, is tests/deploy/test_skypilot_multinode.py."""
from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest
import yaml

from pilotrun.campaign.engines.base import EngineRefusal
from pilotrun.campaign.engines.nodes import Leader, NodeError, NodeGroup, follow, plan_nodes
from pilotrun.campaign.orchestrate import prepare
from pilotrun.campaign.spec import load_campaign
from pilotrun.config import load_spec
from tests.conftest import FIXTURES, pilotrun_cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toy_campaign(tmp_path: Path, strategy: str = "ddp") -> Path:
    work = tmp_path / "toy"
    work.mkdir(parents=True)
    (work / "toy.py").write_bytes((FIXTURES / "toy" / "toy.py").read_bytes())
    body = yaml.safe_load((FIXTURES / "toy" / "pilot.yaml").read_text()) | {"distributed": {"strategy": strategy}}
    (work / "pilot.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
    (work / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "sweep", "base": "pilot.yaml", "vary": {"train.optimizer.lr": [3.0e-3, 1.0e-3]}, "seeds": [1],
        "updates": 2, "eval": {"every": 1}}, sort_keys=False))
    return work / "sweep.yaml"


def test_the_cluster_is_checked_where_it_is_given_and_each_node_starts_its_own_ranks_in_node_order():
    g = NodeGroup(nnodes=2, node_rank=1, per_node=8, endpoint="10.0.0.5:29500")
    assert (g.world, g.host, g.port, g.store_port) == (16, "10.0.0.5", 29500, 29501)
    cmd = g.torchrun(["--run-id", "r01"])
    # static rendezvous: node R holds ranks R*8 .. R*8+7, so rank 0 (the run's end, its validations) is on node 0
    assert cmd[3:8] == ["--nnodes=2", "--node-rank=1", "--nproc-per-node=8", "--master-addr=10.0.0.5",
                        "--master-port=29500"]
    assert cmd[-4:] == ["-m", "pilotrun.campaign.worker", "--run-id", "r01"]
    for bad, said in [(dict(nnodes=1), "--nnodes is at least 2"), (dict(node_rank=2), "--node-rank is 0 .. nnodes-1"),
                      (dict(per_node=0), "--nproc-per-node 0"), (dict(endpoint="head"), "give HOST:PORT of node 0")]:
        with pytest.raises(NodeError, match=said):
            NodeGroup(**(dict(nnodes=2, node_rank=0, per_node=1, endpoint="h:1") | bad))


def test_a_campaign_over_nodes_is_one_run_at_a_time_of_the_clusters_world_size_or_refused_naming_the_fix(tmp_path):
    g = NodeGroup(nnodes=2, node_rank=0, per_node=4, endpoint="h:29500")
    ddp = load_spec(_toy_campaign(tmp_path).with_name("pilot.yaml"))
    plan = plan_nodes(g, None, ddp, processes=1, cpus=32)
    assert (plan["parallel"], plan["threads_per_run"], plan["nodes"]["world"]) == (1, 8, 8)
    assert plan["text"].startswith("one run at a time, each 8 ranks over 2 nodes x 4")
    assert plan_nodes(g, 1, ddp, processes=8, cpus=2)["threads_per_run"] == 1  # gpus_per_run: the world size
    single = load_spec(_toy_campaign(tmp_path / "s", "single").with_name("pilot.yaml"))
    for args, said in [((None, single, 1), "distributed.strategy is single: set it to"),
                       ((None, ddp, 4), "gpus_per_run is 4, but --nnodes 2 x --nproc-per-node 4 make each run 8"),
                       ((2, ddp, 1), "--parallel 2: with --nnodes every run spans all the nodes")]:
        with pytest.raises(EngineRefusal, match=said):
            plan_nodes(g, *args, cpus=8)


def test_a_node_whose_files_give_another_spec_refuses_the_run_and_every_node_ends_with_node_0(tmp_path):
    campaign = _toy_campaign(tmp_path)
    group = NodeGroup(nnodes=2, node_rank=0, per_node=1, endpoint=f"127.0.0.1:{_free_port()}")
    runs, _ = prepare(load_campaign(campaign))
    ended: list = []
    with Leader(group) as leader:
        follower = threading.Thread(target=lambda: ended.append(follow(
            NodeGroup(2, 1, 1, group.endpoint), campaign, tmp_path / "node1")), daemon=True)
        follower.start()
        # node 0's spec differs from what node 1's campaign file gives (another file, another hash): refused, and
        # nothing of it started on node 1
        said = leader.offer({"run_id": "c-r01", "config_hash": "0" * 64, "out": str(tmp_path / "c-r01"),
                             "plan": {"updates": 2, "eval_every": 1}, "deadline": None, "threads": 1})
        assert not said.silent and len(said.refused) == 1
        assert said.refused[0].startswith("node 1 refused it: its spec (config hash 000000000000) is not one that")
        assert "the nodes' files differ" in said.refused[0] and not (tmp_path / "node1").exists()
        assert leader.store.get("go/c-r01") == b'{"go": false}'  # no node starts a rendezvous node 0 will not join
        assert runs[0]["config_hash"] != "0" * 64
        leader.end(3)
    follower.join(timeout=30)
    assert ended == [3]  # the follower ends with node 0's exit code


@pytest.mark.process
def test_the_flags_of_a_campaign_over_nodes_are_checked_before_anything_runs(tmp_path):
    campaign = _toy_campaign(tmp_path)
    for args, said in [(["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
                       (["--node-rank", "1"], "--node-rank, --rdzv-endpoint and --nproc-per-node go with --nnodes"),
                       (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--nproc-per-node", "1", "--engine", "ray"],
                        "leave out --engine ray")]:
        res = pilotrun_cli("campaign", str(campaign), *args, cwd=tmp_path)
        assert res.returncode == 2 and said in res.stderr, res.stdout + res.stderr
    assert not (tmp_path / "runs").exists()


def test_a_nodes_rows_go_to_node_0_in_chunks_the_store_takes_and_leave_it_once_read(tmp_path, monkeypatch):
    from pilotrun.campaign.engines import nodes

    monkeypatch.setattr(nodes, "CHUNK_BYTES", 200)  # the store's limit is 8 MiB; a small one shows the chunks
    group = NodeGroup(nnodes=2, node_rank=0, per_node=1, endpoint=f"127.0.0.1:{_free_port()}")
    items = [["metrics", "c-r01", "train", [{"step": i, "loss": 1.0 / i, "sample_ids": list(range(8))}], 1]
             for i in range(1, 11)]
    with Leader(group) as leader:
        nodes.send_rows(leader.store, "rows/c-r01/1", items)
        assert json.loads(leader.store.get("rows/c-r01/1"))["chunks"] == 10  # one point of ~90 bytes each
        assert nodes.take_rows(leader.store, "rows/c-r01/1", 1.0) == items
        assert not leader.store.check(["rows/c-r01/1"]) and not leader.store.check(["rows/c-r01/1/0"])
        assert nodes.take_rows(leader.store, "rows/c-r02/1", 0.2) is None  # a node that sent nothing
        leader.lost = ["node 1 stopped answering"]  # nobody to wait for at the end


def test_a_node_that_stops_answering_leaves_the_rest_of_the_campaign_not_run_for_a_restart(tmp_path, monkeypatch):
    from pilotrun.campaign.engines import nodes
    from pilotrun.campaign.orchestrate import run_row
    from pilotrun.ledger.records import RunKind, StopKind
    from pilotrun.ledger.store import Ledger

    monkeypatch.setattr(nodes, "TAKE_WAIT_S", 0.5)
    campaign = _toy_campaign(tmp_path)
    runs, _ = prepare(load_campaign(campaign))
    ledger, plan_file = tmp_path / "l.sqlite", tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"updates": 2, "eval_every": 1}))
    with Ledger(ledger) as led:
        led.start_run("c", "sweep", RunKind.CAMPAIGN)
        for i, r in enumerate(runs):
            r["run_id"], r["out"] = f"c-r0{i + 1}", tmp_path / f"c-r0{i + 1}"
        led.plan_runs([run_row("c", "train.optimizer.lr", r["run_id"], r["spec"], r["out"], r) for r in runs])
    group = NodeGroup(nnodes=2, node_rank=0, per_node=1, endpoint=f"127.0.0.1:{_free_port()}")
    with Leader(group) as leader:  # node 1 never started
        engine = nodes.NodesEngine(leader)
        for r in runs:
            engine.launch(r, ledger, plan_file, None, 1)
        assert leader.lost == ["node 1 stopped answering"] and leader.offered == 1  # the second run was not offered
    with Ledger(ledger) as led:
        ends = [led.run(r["run_id"]) for r in runs]
    metas = [json.loads(e["meta_json"]) for e in ends]
    assert [e["status"] for e in ends] == ["not-run", "not-run"]  # cut short: --task-id continues them
    assert {m["stop_kind"] for m in metas} == {str(StopKind.WORKER_LOST)}
    assert metas[0]["stop_reason"].startswith("not started on the cluster: node 1 did not take the run within 0.5 s")
    assert metas[1]["stop_reason"] == "node 1 stopped answering: not started"
