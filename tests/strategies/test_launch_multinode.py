"""A pilot over several machines: torchrun's c10d rendezvous, one run id, each rank's rows.

The end-to-end test starts two "nodes" as two `pilotrun launch` processes on 127.0.0.1 (gloo, one
process each), each in its own folder with its own ledger, as two machines would be; the pure parts
(the rendezvous id, which report a node reads, the run id agreement's refusals) are unit tests.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from pilotrun import distributed
from pilotrun.cli.launch import find_report, rendezvous_id
from tests.conftest import TEST_DIGEST, copy_example


def test_the_rendezvous_id_is_what_every_node_can_derive_from_the_same_command():
    a = rendezvous_id("tiny-sft", "10.0.0.1:29500", 2, None)
    assert a == rendezvous_id("tiny-sft", "10.0.0.1:29500", 2, None) and a.startswith("pilotrun-tiny-sft-")
    assert len({a, rendezvous_id("tiny-sft", "10.0.0.2:29500", 2, None), rendezvous_id("tiny-sft", "10.0.0.1:29500",
                                                                                       3, None)}) == 3
    assert rendezvous_id("tiny-sft", "10.0.0.1:29500", 2, "my-run") == "my-run"  # a given run id is shared anyway


def test_a_node_reads_the_combined_report_or_its_own_ranks(tmp_path):
    assert find_report(None) is None and find_report(tmp_path) is None
    (tmp_path / "report-rank3.json").write_text("{}")
    (tmp_path / "report-rank2.json").write_text("{}")
    assert find_report(tmp_path) == tmp_path / "report-rank2.json"
    (tmp_path / "report.json").write_text("{}")
    assert find_report(tmp_path) == find_report(tmp_path, 0) == tmp_path / "report.json"
    # Another node reads its own first rank's report even where rank 0's is in the same (shared) folder.
    assert find_report(tmp_path, 3) == tmp_path / "report-rank3.json"


def _as_rank0_seeing(monkeypatch, proposals):
    """agree_run_id as rank 0 of two sees it, the other rank's proposal given (the collectives replaced)."""
    env = distributed.DistEnv(0, 0, 2, "ddp")
    monkeypatch.setattr(distributed, "gather", lambda env, obj: [obj, *proposals])
    monkeypatch.setattr(distributed, "broadcast", lambda env, obj: obj)
    monkeypatch.setattr(distributed, "shutdown", lambda env: None)
    return env


def test_rank_0s_id_is_taken_and_different_given_ids_or_configs_are_refused(monkeypatch, tmp_path):
    # One process: no collective, the given id or a new one.
    assert distributed.agree_run_id(distributed.DistEnv(), None, lambda: "solo", "h") == "solo"
    assert distributed.agree_run_id(distributed.DistEnv(), "given", lambda: "solo", "h") == "given"
    env = _as_rank0_seeing(monkeypatch, [(1, None, "h1")])
    monkeypatch.setenv(distributed.RUN_ID_FILE_VAR, str(tmp_path / "id"))
    assert distributed.agree_run_id(env, None, lambda: "job-20260101-000000-abcd", "h1") == "job-20260101-000000-abcd"
    assert (tmp_path / "id").read_text().split() == ["job-20260101-000000-abcd", "0"]  # for this node's launcher
    env = _as_rank0_seeing(monkeypatch, [(1, "other", "h1")])
    with pytest.raises(distributed.LaunchError, match="different --run-id values .mine on rank 0, other elsewhere"):
        distributed.agree_run_id(env, "mine", lambda: "unused", "h1")
    env = _as_rank0_seeing(monkeypatch, [(1, None, "h2")])
    with pytest.raises(distributed.LaunchError, match="different configs .rank 0: h1, rank 1: h2.*same --set"):
        distributed.agree_run_id(env, None, lambda: "x", "h1")


@pytest.mark.parametrize("nnodes, node_rank, endpoint, says", [
    (2, 0, None, "--nnodes > 1 needs --rdzv-endpoint HOST:PORT"),
    (2, 2, "127.0.0.1:29500", "--node-rank is 0 .. nnodes-1"),
    (0, 0, None, "--nnodes is at least 1"),
    (2, 1, "head", "--rdzv-endpoint 'head' is not HOST:PORT"),
])
def test_a_launch_that_cannot_meet_is_refused_before_anything_starts(tmp_path, monkeypatch, nnodes, node_rank,
                                                                     endpoint, says):
    from pilotrun.cli import launch
    from pilotrun.cli.common import UsageError

    spec = copy_example("tiny-sft", tmp_path)
    args = argparse.Namespace(spec=str(spec), overrides=["distributed.strategy=ddp"], container_digest=None,
                              nproc_per_node=1, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=endpoint,
                              rdzv_id=None, run_id=None, ledger=tmp_path / "l.sqlite", out=None, gates=None)
    with pytest.raises(UsageError, match=says):
        launch.main(args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.process
def test_two_nodes_on_loopback_share_one_run_id_and_each_rank_writes_its_rows(tmp_path):
    port = _free_port()
    env = {**os.environ, "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    nodes = []
    for r in (0, 1):  # two machines: each its own folder, spec copy and ledger, the same command but --node-rank
        home = tmp_path / f"node{r}"
        spec = copy_example("tiny-sft", home)
        cmd = [sys.executable, "-m", "pilotrun", "launch", "--nnodes", "2", "--node-rank", str(r),
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "1", str(spec.relative_to(home)),
               "--set", "distributed.strategy=ddp", "--gates", "load"]
        nodes.append((home, subprocess.Popen(cmd, cwd=home, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True)))
    outputs = []
    try:
        for _, proc in nodes:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for _, proc in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for (home, proc), out in zip(nodes, outputs):
        assert proc.returncode == 0, out
        # Before rank 0 names the run, a node's launcher keeps torchrun's folder under runs/ (never /tmp).
        assert len(list((home / "runs" / "torchrun").iterdir())) == 1
    assert not list(Path(env["TMPDIR"]).glob("torchelastic_*"))  # this test's own (tests/conftest.py)
    run_ids, ranks = set(), {}
    for home, _ in nodes:
        with sqlite3.connect(home / "runs" / "ledger.sqlite") as db:
            runs = db.execute("SELECT run_id, status FROM runs").fetchall()
            rows = db.execute("SELECT run_id, gate, rank, world_size, verdict FROM gate_rows").fetchall()
        assert len(runs) == 1 and runs[0][1] == "pass", runs  # the run is in each node's ledger, ended
        run_ids.add(runs[0][0])
        for run_id, gate, rank, world, verdict in rows:
            assert (run_id, gate, world, verdict) == (runs[0][0], "load", 2, "pass")
            ranks[rank] = home.name
    assert len(run_ids) == 1, run_ids  # one id, agreed by the nodes
    (run_id,) = run_ids
    assert sorted(ranks) == [0, 1] and len(set(ranks.values())) == 2  # one rank per node, each in its own ledger
    assert all(f"run {run_id}" in out for out in outputs)  # each launcher names the agreed run
    combined = json.loads((tmp_path / ranks[0] / "runs" / run_id / "report.json").read_text())
    assert combined["run_id"] == run_id and sorted(g["rank"] for g in combined["gates"]) == [0, 1]
    assert (tmp_path / ranks[1] / "runs" / run_id / "report-rank1.json").exists()
    said = dict(zip([home.name for home, _ in nodes], outputs))  # each launcher read the report its node wrote
    assert f"report runs/{run_id}/report.json" in said[ranks[0]]
    assert f"report runs/{run_id}/report-rank1.json" in said[ranks[1]]
