"""Multi-GPU runs in campaigns (issue 47, deliverable 3): ``gpus_per_run`` (or a program's launcher count) is how many
devices, one process each, a run takes; the local engine hands each run its own set from the visible ones (runs side
by side never share one); Ray asks for that many per task with torchrun inside; rank 0 reports the run and a stop rule
stops every rank at the same update.

Pure tests read the campaign file and plan against a patched device inventory (``orchestrate.query_devices``, the one
function that asks). Two process tests run the same 2-run program campaign as real ``torch.distributed.run
--nproc-per-node 2`` groups on gloo (devices as processes): on the local engine, with four GPUs patched in so each run
gets its own two, and on a local Ray instance."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import psutil
import pytest
import yaml

from pilotrun.campaign import orchestrate
from pilotrun.campaign.engines import local
from pilotrun.campaign.run_plan import CampaignRunPlan
from pilotrun.campaign.spec import load_campaign, run_size
from pilotrun.campaign.stops import tell_ranks
from pilotrun.campaign.worker import group_command
from pilotrun.config import load_spec
from pilotrun.config.schema import SpecError
from pilotrun.devices import DeviceInventory
from tests.campaign.test_campaign_ray import ray_env  # noqa: F401 — the fixture: a per-test RAY_TMPDIR and its processes marked
from tests.conftest import FIXTURES, ledger_rows, pilotrun_cli

# Two ranks on gloo, each on its half of a tiny regression, gradients all-reduced: every update is a collective, so a
# rank stopping alone would hang the other. Each rank reports the devices it was given.
GROUP_PROGRAM = """
import argparse, os
import torch
import torch.distributed as dist
import pilotrun

cli = argparse.ArgumentParser()
cli.add_argument("--lr", type=float)
cli.add_argument("--updates", type=int)
a = cli.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
job = pilotrun.program()
torch.manual_seed(0)
x = torch.randn(32, 4)
y = x @ torch.randn(4, 1)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
for update in range(1, a.updates + 1):
    loss = torch.nn.functional.mse_loss(model(x[rank::world]), y[rank::world])
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    job.update(update, loss=loss.item(), lr=a.lr, world=world, devices=os.environ.get("CUDA_VISIBLE_DEVICES", "-"))
    if update == a.updates:
        job.evaluated(update, loss.item())
    if job.should_stop(update):
        break
dist.destroy_process_group()
"""
UPDATES = 6
LAUNCH = "python -m torch.distributed.run --standalone --nproc-per-node 2 train.py"


def _gpus(n: int) -> DeviceInventory:
    return DeviceInventory("cuda", n, ("NVIDIA H100 80GB HBM3",) * n, (80 * 2**30,) * n)


def _program(tmp_path: Path, command: str = LAUNCH, **over) -> Path:
    (tmp_path / "prog").mkdir(exist_ok=True)
    (tmp_path / "prog" / "train.py").write_text(GROUP_PROGRAM)
    (tmp_path / "prog" / "pilot.yaml").write_text(yaml.safe_dump({"name": "prog", "program": {"command": command}}))
    body = {"name": "pair", "base": "prog/pilot.yaml", "vary": {"lr": [0.02, 5.0]}, "seeds": [1], "updates": UPDATES,
            "stop": {"divergence": 3.0}, "program": {"args": ["--lr", "{value}", "--updates", "{updates}"]}, **over}
    path = tmp_path / "pair.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def _loop(tmp_path: Path, **over) -> Path:
    import shutil

    shutil.copytree(FIXTURES / "toy", tmp_path / "toy")
    base = tmp_path / "toy" / "pilot.yaml"
    base.write_text(base.read_text() + "\ndistributed: {strategy: ddp}\n")
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "sweep", "base": "toy/pilot.yaml", "vary": {"train.optimizer.lr": [0.01,
                                    0.02]}, "seeds": [1, 2], "updates": 4, **over}, sort_keys=False))
    return path


# -- the campaign file ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("command", "over", "words"), [
    (LAUNCH, {"gpus_per_run": 3}, "the base's program.command starts 2 process(es)"),
    ("python train.py", {"gpus_per_run": 0}, "must be at least 1"),
])
def test_a_gpus_per_run_that_cannot_hold_is_refused_naming_the_key(tmp_path, command, over, words):
    with pytest.raises(SpecError) as err:
        load_campaign(_program(tmp_path, command, **over))
    assert any(f == "gpus_per_run" and words in m for f, m in err.value.problems), err.value.problems


def test_gpus_per_run_and_its_older_name_must_agree_and_an_absent_one_keeps_the_digest(tmp_path):
    with pytest.raises(SpecError) as err:
        load_campaign(_loop(tmp_path, gpus_per_run=2, processes=4))
    assert any(f == "gpus_per_run" and "disagree" in m for f, m in err.value.problems), err.value.problems
    path = _loop(tmp_path / "b", processes=2)
    old = load_campaign(path)
    assert old.ranks == 2 and "gpus_per_run" not in old.canonical()  # a campaign written before it: same digest
    path.write_text(path.read_text().replace("processes: 2", "gpus_per_run: 2"))
    assert load_campaign(path).ranks == 2


def test_each_run_gets_its_own_devices_for_the_loop_and_for_a_program_without_a_launcher(tmp_path, monkeypatch):
    """Four GPUs visible: a run of 2 ranks of pilotrun's loop, and a plain `python train.py` given gpus_per_run 2,
    each take two, so two runs go at once and never share one; three GPUs leave the third idle, not half a run."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(orchestrate, "query_devices", lambda: _gpus(4))
    loop = load_campaign(_loop(tmp_path, gpus_per_run=2))
    prog = load_campaign(_program(tmp_path, "python train.py", gpus_per_run=2))
    for c in (loop, prog):
        base = load_spec(c.folder / c.base, allow_program=True)
        assert run_size(c, base) == 2
        plan = orchestrate.parallel_plan(c, base, 4, tmp_path / "l.sqlite")
        assert plan["devices"]["slots"] == [["0", "1"], ["2", "3"]] and plan["parallel"] == 2, plan
        assert plan["devices"]["env_var"] == "CUDA_VISIBLE_DEVICES"
    assert CampaignRunPlan.of(loop).processes == 2 and CampaignRunPlan.of(prog).processes == 1
    monkeypatch.setattr(orchestrate, "query_devices", lambda: _gpus(1))
    with pytest.raises(orchestrate.CampaignError, match=r"each run starts 2 processes.*\(gpus_per_run\)"):
        orchestrate.parallel_plan(loop, load_spec(loop.folder / loop.base), 4, tmp_path / "l.sqlite")


def test_a_cluster_is_asked_for_gpus_per_run_gpus_per_task():
    from pilotrun.campaign.engines.base import EngineChoice
    from pilotrun.campaign.engines.ray import RayEngine

    class FourGpus(RayEngine):
        def cluster(self):
            return {"CPU": 16.0, "GPU": 4.0}

    eng = FourGpus(EngineChoice("ray"), Path("unused.sqlite"))
    spec = load_spec(FIXTURES / "toy" / "pilot.yaml")
    plan = orchestrate.cluster_plan(eng, None, 4, spec, None, 2)
    assert plan["resources"] == {"num_cpus": 2, "num_gpus": 2} and plan["parallel"] == 2, plan
    assert eng.processes == 2


def test_the_local_engine_starts_a_run_of_the_loop_as_torchrun_ranks_on_its_slot_and_stops_every_rank(
        tmp_path, monkeypatch):
    """What the local engine starts for a campaign of gpus_per_run 2 (the real group runs in the process tests of
    Ray's loop and of programs here): torchrun with two ranks of the worker writing the ledger, its files in the run's
    folder, the run's two devices visible; and a stop goes to the ranks (tell_ranks), not to torchrun."""
    started, told = [], []

    class FakeTree:  # what LocalEngine._start hands the command to (procs.Tree), recorded instead of started
        pid = os.getpid()

        def __init__(self, cmd, *, env, label, **popen):
            started.append((cmd, env))

        def wait(self, timeout=None):
            return 0

        def kill(self):
            return None

    class NoLedger:
        def __init__(self, path):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def merge_meta(self, run_id, meta):
            started.append(meta)

    monkeypatch.setattr(local, "Tree", FakeTree)
    monkeypatch.setattr(local, "Ledger", NoLedger)
    monkeypatch.setattr(local, "tell_ranks", lambda pid, signum: told.append((pid, signum)) or 2)
    devices = {"mode": "per-run", "backend": "cuda", "env_var": "CUDA_VISIBLE_DEVICES", "slots": [["2", "3"]]}
    running = local.LocalEngine(tmp_path, devices, ranks=2)
    out = tmp_path / "r01"
    out.mkdir()
    spec = types.SimpleNamespace(source=str(tmp_path / "pilot.yaml"), written={"name": "x"})
    running.launch({"run_id": "r01", "out": out, "spec": spec}, tmp_path / "l.sqlite", tmp_path / "plan.json", None,
                   threads=1)
    (cmd, env), meta = started
    assert cmd[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    assert cmd[6] == "pilotrun.campaign.worker" and cmd[cmd.index("--ledger") + 1] == str(tmp_path / "l.sqlite")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and meta["devices"] == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert str(out / "torchrun") in env.values()
    running.procs["r01"] = FakeTree([], env={}, label="x")
    running.stop_all("SIGTERM")
    assert told == [(os.getpid(), signal.SIGUSR1)]


def _ended(p: psutil.Process) -> bool:
    """Gone, or a zombie its parent (which never waits, as torchrun would) has not reaped."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.process
def test_a_stop_reaches_every_rank_and_neither_torchrun_nor_a_ranks_own_children():
    """tell_ranks signals the ranks only: torchrun would die of SIGUSR1 (it does not handle it) before the ranks
    recorded where they stopped, and a rank's forked DataLoader workers carry its command line too."""
    rank = "import os, time; os.fork(); time.sleep(60)"  # the rank and its forked child: the same command line
    launcher = (f"import subprocess, sys, time; [subprocess.Popen([sys.executable, '-c', {rank!r}, '-m', "
                "'pilotrun.campaign.worker']) for _ in range(2)]; time.sleep(60)")
    root = subprocess.Popen([sys.executable, "-c", launcher, "torch.distributed.run", "pilotrun.campaign.worker"])
    forked: list[psutil.Process] = []
    try:
        tree = psutil.Process(root.pid)
        deadline = time.monotonic() + 30
        while len(tree.children(recursive=True)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = tree.children()
        forked += [c for r in ranks for c in r.children()]
        assert len(ranks) == 2 and len(forked) == 2
        assert tell_ranks(root.pid, signal.SIGTERM) == 2
        deadline = time.monotonic() + 10
        while not all(_ended(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_ended(r) for r in ranks) and root.poll() is None and not any(_ended(c) for c in forked)
    finally:
        for p in [*psutil.Process(root.pid).children(recursive=True), *forked]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        root.kill()
        root.wait()
    assert group_command(2, ["--spec", "s.json"])[1:6] == ["-m", "torch.distributed.run", "--standalone",
                                                           "--nproc-per-node=2", "-m"]


# -- real groups ----------------------------------------------------------------------------------------------------

def _check_group_rows(ledger: Path, devices_apart: bool) -> list[dict]:
    """Every run ran as 2 ranks; the control finished with rank 0's validation; the diverging one was stopped by the
    rule read on rank 0's losses, and rank 1 stopped at the very same update."""
    runs = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign-run' ORDER BY rowid")
    assert len(runs) == 2
    seen = []
    for r in runs:
        meta = json.loads(r["meta_json"])
        points = ledger_rows(ledger, "SELECT gate, rank, step, extra_json FROM metrics WHERE run_id = ? "
                                     "ORDER BY gate, rank, step", r["run_id"])
        last = {(p["gate"], p["rank"]): p["step"] for p in points}
        extras = [json.loads(p["extra_json"] or "{}") for p in points if p["gate"] == "train"]
        assert {e.get("world") for e in extras} == {2}, extras
        if meta["variant"] == 0.02:
            assert r["status"] == "finished", meta
            assert last == {("train", 0): UPDATES, ("train", 1): UPDATES, ("val", 0): UPDATES}
        else:
            assert (r["status"], meta["stop_kind"]) == ("diverged", "divergence"), meta
            assert last[("train", 0)] == last[("train", 1)] == meta["stopped_at"] < UPDATES, (last, meta)
        seen.append((r, {e["devices"] for e in extras}, meta))
    if devices_apart:  # each run saw its own pair, as its row says; the two pairs share no device
        pairs = [s for _, s, _ in seen]
        assert all(len(p) == 1 for p in pairs) and pairs[0].isdisjoint(pairs[1]), pairs
        for _, p, meta in seen:
            assert meta["devices"] == {"CUDA_VISIBLE_DEVICES": next(iter(p))} and len(next(iter(p)).split(",")) == 2
    return runs


@pytest.mark.process
def test_a_program_campaign_runs_every_run_as_two_ranks_on_their_own_devices_locally(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(orchestrate, "query_devices", lambda: _gpus(4))  # the campaign runs in this process
    ledger = tmp_path / "l.sqlite"
    res = pilotrun_cli("campaign", str(_program(tmp_path)), "--parallel", "2", "--ledger", str(ledger), "--out",
                       str(tmp_path / "runs"), "--json", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    plan = json.loads(res.stdout)["parallel"]
    assert plan["devices"]["slots"] == [["0", "1"], ["2", "3"]] and plan["parallel"] == 2, plan
    _check_group_rows(ledger, devices_apart=True)


@pytest.mark.process
def test_a_program_campaign_runs_every_run_as_two_ranks_in_a_ray_task(tmp_path, ray_env):  # noqa: F811
    ledger = tmp_path / "ray.sqlite"
    res = pilotrun_cli("campaign", str(_program(tmp_path)), "--engine", "ray", "--ledger", str(ledger), "--out",
                       str(tmp_path / "runs"), "--json", cwd=tmp_path, env=ray_env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    # A CPU per rank on a CPU-only machine (a GPU per rank where the cluster has them: the test above).
    assert json.loads(res.stdout)["parallel"]["resources"] == {"num_cpus": 2, "num_gpus": 0}
    for r in _check_group_rows(ledger, devices_apart=False):
        assert json.loads(r["meta_json"])["ray"]["node_id"]  # it ran as a Ray task (the relay's start row)

