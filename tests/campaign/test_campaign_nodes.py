"""A campaign whose every run spans several nodes (engines/nodes.py): the cluster as flags, the plan it allows, and
the store between node 0 and the others, in one process (a real TCPStore on loopback). The whole path, two "nodes" of
real processes running a SkyPilot task's script, is tests/deploy/test_skypilot_multinode.py."""
from __future__ import annotations

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
        refused = leader.offer({"run_id": "c-r01", "config_hash": "0" * 64, "out": str(tmp_path / "c-r01"),
                                "plan": {"updates": 2, "eval_every": 1}, "deadline": None, "threads": 1})
        assert len(refused) == 1 and refused[0].startswith("node 1 refused it: its spec (config hash 000000000000) "
                                                           "is not one that")
        assert "the nodes' files differ" in refused[0] and not (tmp_path / "node1").exists()
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
