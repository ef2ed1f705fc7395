"""Campaigns on Ray (``--engine ray``): the same rows as the local engine, the ledger written by the driver
only, and a lost node's run kept as ``stopped`` at its last recorded update.

The pure parts (how many runs the cluster fits, how a Ray error is read) are unit tests. Two real-engine
tests: a local Ray instance running a 2-lr x 2-seed campaign where one lr diverges, compared row by row with
the local engine on the same file; and a real two-node cluster on 127.0.0.1 (``ray start --head`` and
``ray start --address``) whose worker node is SIGKILLed mid-run. Every Ray process a test starts carries
a per-test environment mark and is killed by it (not ``ray stop``, which would stop every Ray on the
machine, a user's included); each test has its own short ``RAY_TMPDIR``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import FIXTURES, TEST_DIGEST, ledger_rows, pilotrun_cli, polled_rows, require

ray = require("ray", "ray[default]")

from pilotrun.campaign.engines.ray import Outcome, classify, lost_end, plan_ray  # noqa: E402
from pilotrun.campaign.resources import PerRun  # noqa: E402
from pilotrun.campaign.runner import FLUSH_EVERY_S  # noqa: E402
from pilotrun.campaign.spool import SpoolReader, SpoolSink  # noqa: E402
from pilotrun.ledger.records import RunEnd, RunStatus, Series, StopKind  # noqa: E402

LRS = [1.0e-2, 3.0]  # the control, and one that diverges on the toy model: its second update's loss is 100-3000x
# the first for every seed tried (the 3x rule cannot depend on the machine; on the demo model lr 1.0 ended near 3x)
MARK = "PILOTRUN_RAY_TEST"
RAY = str(Path(sys.executable).with_name("ray"))


# -- pure parts ----------------------------------------------------------------------------------

def test_the_cluster_caps_the_runs_at_once_and_says_which_resource_did():
    p = plan_ray(None, 4, cluster={"CPU": 2.0, "memory": 8 * 2**30}, gpus_per_run=0, cpus_per_run=1, per_run=None)
    assert (p["parallel"], p["resources"]) == (2, {"num_cpus": 1, "num_gpus": 0})
    assert p["reasons"] == ["the Ray cluster has 2 CPU(s), 1 per run"] and "memory not checked" in p["not_checked"][0]
    gpu = plan_ray(None, 9, cluster={"CPU": 64.0, "GPU": 8.0}, gpus_per_run=1, cpus_per_run=1, per_run=None)
    assert gpu["parallel"] == 8 and gpu["reasons"] == ["the Ray cluster has 8 GPU(s), 1 per run (the spec's world size)"]
    measured = PerRun(host_bytes=3 * 2**30, device_bytes=None, source="pilot-1")
    mem = plan_ray(2, 9, cluster={"CPU": 64.0, "memory": 7 * 2**30}, gpus_per_run=0, cpus_per_run=1, per_run=measured)
    # --parallel 2 asked for and the memory (7 GiB / 3 GiB per run) allows 2: no limit is named.
    assert (mem["parallel"], mem["reasons"], mem["resources"]["memory"]) == (2, [], 3 * 2**30)
    assert plan_ray(4, 9, cluster={"CPU": 64.0, "memory": 7 * 2**30}, gpus_per_run=0, cpus_per_run=1,
                    per_run=measured)["reasons"][0].startswith("the Ray cluster's memory: 7.0 GiB")


def test_a_lost_worker_is_told_from_a_raised_error_and_a_cancel_by_its_type():
    import ray.exceptions as rex

    assert classify(None) == Outcome.RETURNED
    assert classify(rex.TaskCancelledError()) == Outcome.CANCELLED
    assert classify(rex.WorkerCrashedError()) == Outcome.LOST
    assert classify(rex.NodeDiedError("node gone")) == Outcome.LOST
    assert classify(ValueError("the run's own bug")) == Outcome.RAISED
    end = lost_end(rex.NodeDiedError("x"), 17, " on node 127.0.0.1")
    assert (end.status, end.stop, end.at) == (RunStatus.STOPPED, StopKind.WORKER_LOST, 17)
    assert end.reason == ("the Ray worker running it was lost (NodeDiedError on node 127.0.0.1); the last update this "
                          "run recorded is 17")


def test_the_spool_hands_over_complete_lines_once_and_keeps_each_rank(tmp_path):
    spool = tmp_path / "spool"
    with SpoolSink(spool / "rank0.jsonl") as r0, SpoolSink(spool / "rank1.jsonl") as r1:
        r0.add_metrics("run", Series.TRAIN, [{"step": 1, "loss": 2.5}], rank=0)
        r1.add_metrics("run", Series.TRAIN, [{"step": 1, "loss": 2.5}], rank=1)
        reader = SpoolReader(spool)
        assert reader.new_items() == [("metrics", "run", "train", [{"step": 1, "loss": 2.5}], 0),
                                      ("metrics", "run", "train", [{"step": 1, "loss": 2.5}], 1)]
        assert reader.new_items() == []
        r0.file.write('["metrics", "run", "tr')  # a line being written: not read until it is whole
        r0.file.flush()
        assert reader.new_items() == []
        r0.file.write('ain", [], 0]\n')
        r0.finish_campaign_run("run", RunEnd(RunStatus.DIVERGED, StopKind.DIVERGENCE, "loss 9 > 3 x 2", 4), final=None)
    assert reader.new_items() == [("metrics", "run", "train", [], 0),
                                  ("end", "run", ["diverged", "divergence", "loss 9 > 3 x 2", 4], {"final": None})]


@pytest.mark.process
def test_address_and_storage_without_the_ray_engine_are_refused(tmp_path):
    res = pilotrun_cli("campaign", "x.yaml", "--address", "127.0.0.1:1", "--ledger", str(tmp_path / "l.sqlite"),
                       cwd=tmp_path)
    assert res.returncode == 2 and "--address and --storage go with --engine ray" in res.stderr, res.stderr


# -- real Ray --------------------------------------------------------------------------------------

def _campaign(tmp_path: Path, **over) -> Path:
    # The toy job, not the demo: these tests are about where runs go and which rows are kept, and each of their ~20
    # run processes would otherwise spend ~3 s importing transformers.
    shutil.copytree(FIXTURES / "toy", tmp_path / "toy")
    body = {"name": "sweep", "base": "toy/pilot.yaml", "vary": {"train.optimizer.lr": LRS}, "seeds": [1, 2],
            "updates": 12, "eval": {"every": 6}, "stop": {"non_finite": True, "divergence": 3.0, "budget_minutes": 20},
            "keep": {"checkpoint": False, "export": True, "control_set": 2}}
    body.update(over)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def _marked(mark: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def _with_children(procs: list[psutil.Process]) -> list[psutil.Process]:
    """``procs`` and everything they started. A raylet's agents (ray::DashboardAgent, ray::RuntimeEnvAgent) and
    workers retitle themselves over their environment, so the mark cannot be read there: they are found as the
    raylet's children, before it is killed and they are orphaned."""
    out = {p.pid: p for p in procs}
    for p in procs:
        try:
            out.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return list(out.values())


def _kill(mark: str) -> None:
    """Every process that carries ``mark`` (a Ray node and its workers) and their children, then check none is
    left."""
    for _ in range(3):
        procs = _with_children(_marked(mark))
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        if not _marked(mark):
            return
    assert not _marked(mark), [p.cmdline() for p in _marked(mark)]


@pytest.fixture
def ray_env():
    """A short per-test RAY_TMPDIR (Ray's sockets must fit 107 bytes) and a mark on every Ray process."""
    tmp = tempfile.mkdtemp(prefix="prray", dir="/tmp")
    mark = uuid.uuid4().hex
    # Small on purpose: node death is noticed in ~2 s instead of 30, and no usage report is attempted.
    # Token authentication off: the cluster is on loopback and lives for one test (a token would be written to
    # the user's ~/.ray and read there by every node).
    env = {"RAY_TMPDIR": tmp, MARK: mark, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_health_check_period_ms": "500",
           "RAY_health_check_failure_threshold": "4", "RAY_health_check_initial_delay_ms": "1000"}
    try:
        yield env
    finally:
        _kill(mark)
        shutil.rmtree(tmp, ignore_errors=True)


def _summary(ledger: Path) -> tuple[list, list]:
    runs = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign-run' ORDER BY rowid")
    camp = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign'")[0]
    rows = []
    for r in runs:
        m = json.loads(r["meta_json"])
        points = ledger_rows(ledger, "SELECT COUNT(*) AS n, MAX(step) AS last FROM metrics "
                                     "WHERE run_id = ? AND gate = 'train'", r["run_id"])[0]
        rows.append((r["run_id"][len(camp["run_id"]):], m["variant"], m["seed"], r["status"], m["stop_kind"],
                     m["stop_reason"], m["stopped_at"], points["n"], points["last"]))
    return rows, json.loads(camp["meta_json"])["conclusion"]["text"]


@pytest.mark.process
def test_a_local_ray_instance_keeps_exactly_the_rows_the_local_engine_keeps(tmp_path, ray_env):
    spec = _campaign(tmp_path)
    ray_ledger, local_ledger = tmp_path / "ray.sqlite", tmp_path / "local.sqlite"
    t0 = time.monotonic()
    res = pilotrun_cli("campaign", str(spec), "--engine", "ray", "--ledger", str(ray_ledger), "--out",
                       str(tmp_path / "runs"), "--storage", str(tmp_path / "store"), "--json", cwd=tmp_path,
                       env=ray_env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    ray_s = time.monotonic() - t0
    res = pilotrun_cli("campaign", str(spec), "--parallel", "2", "--ledger", str(local_ledger), "--out",
                       str(tmp_path / "runs"), "--json", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    ray_rows, ray_text = _summary(ray_ledger)
    local_rows, local_text = _summary(local_ledger)
    assert ray_rows == local_rows, (ray_rows, local_rows)
    assert ray_text == local_text
    assert [r[0] for r in ray_rows] == [f"-r{i:02d}" for i in range(1, 5)]
    diverged = [r for r in ray_rows if r[1] == LRS[1]]
    assert [r[3:5] for r in diverged] == [("diverged", "divergence")] * 2, diverged
    assert all(r[6] == r[8] >= 1 for r in diverged)  # stopped where its last point is: every update kept once
    assert all(r[3] == "finished" and r[7] == 12 for r in ray_rows if r[1] == LRS[0])
    # Where the files went (--storage) is recorded, and each run says which node and process ran it.
    camp = ledger_rows(ray_ledger, "SELECT meta_json FROM runs WHERE kind = 'campaign'")[0]
    engine = json.loads(camp["meta_json"])["engine"]
    assert engine["name"] == "ray" and Path(engine["storage"]).parent == (tmp_path / "store").resolve()
    for r in ledger_rows(ray_ledger, "SELECT * FROM runs WHERE kind = 'campaign-run'"):
        meta = json.loads(r["meta_json"])
        assert Path(r["out_dir"]).parent == Path(engine["storage"]) and meta["ray"]["node_id"]
        assert (Path(r["out_dir"]) / "predictions.json").is_file()
        assert (Path(r["out_dir"]) / "export").is_dir() == (r["status"] == "finished")
        if r["status"] == "finished":  # recorded through the relay, as the local engine records it
            sha = hashlib.sha256((Path(r["out_dir"]) / "export" / "manifest.json").read_bytes()).hexdigest()
            assert meta["manifests"] == {"export": sha}, meta.get("manifests")
    # The same HTML report reads it.
    cid = json.loads(camp["meta_json"])["engine"]["storage"].rsplit("/", 1)[1]
    rep = pilotrun_cli("report", cid, "--ledger", str(ray_ledger), "--out", str(tmp_path / "report.html"), cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    # A retry on Ray is a new run linked to its parent, in the campaign's storage; the parent's row is untouched.
    before = ledger_rows(ray_ledger, "SELECT * FROM runs WHERE run_id = ?", f"{cid}-r03")[0]
    res = pilotrun_cli("campaign", cid, "--retry", "r03", "--set", "train.micro_batch_size=2", "--set",
                       "train.grad_accum_steps=4", "--engine", "ray", "--ledger", str(ray_ledger), "--json",
                       cwd=tmp_path, env=ray_env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    new = ledger_rows(ray_ledger, "SELECT * FROM runs WHERE run_id = ?", f"{cid}-r05")[0]
    assert new["parent_id"] == f"{cid}-r03" and new["status"] in ("finished", "diverged")
    assert Path(new["out_dir"]).parent == Path(engine["storage"]) and json.loads(new["meta_json"])["ray"]["pid"]
    assert ledger_rows(ray_ledger, "SELECT * FROM runs WHERE run_id = ?", f"{cid}-r03")[0] == before
    assert not _marked(ray_env[MARK]), "the campaign left Ray processes behind"
    print(f"ray campaign: {ray_s:.1f} s")


def _toy_campaign(tmp_path: Path, name: str, factories: str, **campaign) -> Path:
    """A campaign over two learning rates of the toy fixture whose model and data come from ``factories`` (the
    source of a module ``name``.py beside the toy's own)."""
    shutil.copytree(FIXTURES / "toy", tmp_path / "toy")
    (tmp_path / "toy" / f"{name}.py").write_text(factories)
    base = yaml.safe_load((tmp_path / "toy" / "pilot.yaml").read_text())
    base["model"]["factory"], base["data"]["factory"] = f"{name}:build_model", f"{name}:build_data"
    (tmp_path / "toy" / "pilot.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({"name": name, "base": "toy/pilot.yaml", "vary": {"train.optimizer.lr": [0.01, 0.003]},
                                    **campaign}, sort_keys=False))
    return spec


# The toy model, through a factory that raises for seed 2 (the run's seed is torch's seed while it builds), and that
# refuses a second build in one process: module state a run leaves behind must never reach another run.
FLAKY = """
import torch
from toy import build_data, build_model as toy_model  # noqa: F401

BUILT = []

def build_model(cfg):
    if torch.initial_seed() == 2:
        raise ValueError("the factory refuses seed 2")
    if BUILT:
        raise RuntimeError(f"this process already built the model of another run (seed {BUILT[0]})")
    BUILT.append(torch.initial_seed())
    return toy_model({k: v for k, v in cfg.items() if k != "factory"})
"""


@pytest.mark.process
def test_a_failing_factory_gives_the_same_row_on_ray_and_each_ray_run_has_a_fresh_process(tmp_path, ray_env):
    spec = _toy_campaign(tmp_path, "flaky", FLAKY, seeds=[1, 2], updates=4, eval={"every": 2},
                         stop={"non_finite": True, "divergence": 3.0, "budget_minutes": 20},
                         keep={"checkpoint": False, "export": False, "control_set": 2})
    ledgers = {"local": tmp_path / "local.sqlite", "ray": tmp_path / "ray.sqlite"}
    # One run at a time, and no worker started ahead: a Ray worker that outlived its task would take the next run.
    env = {**ray_env, "RAY_prestart_worker_first_driver": "0"}
    for engine, ledger in ledgers.items():
        res = pilotrun_cli("campaign", str(spec), "--engine", engine, "--parallel", "1", "--ledger", str(ledger),
                           "--out", str(tmp_path / "runs"), "--json", cwd=tmp_path, env=env, timeout=300)
        # Exit 1: two runs failed and no retry followed them; named on stderr, every row kept, the JSON still written.
        assert res.returncode == 1, res.stdout + res.stderr
        camp, said = json.loads(res.stdout)["campaign_id"], " ".join(res.stderr.split())
        assert "2 run(s) failed" in said and f"{camp}-r02 (building the job raised ValueError" in said, said
        assert f"pilotrun campaign {camp} --retry RUN" in said, said
    (local, local_text), (on_ray, ray_text) = _summary(ledgers["local"]), _summary(ledgers["ray"])
    assert on_ray == local and ray_text == local_text, (on_ray, local)
    # The run records a job that cannot be built itself, with the exception (not "process lost", not Ray's wrapper).
    assert [r[3:7] for r in local if r[2] == 2] == [
        ("failed", "error", "building the job raised ValueError: the factory refuses seed 2", 0)] * 2
    assert [r[3] for r in local if r[2] == 1] == ["finished"] * 2
    pids = [json.loads(r["meta_json"])["ray"]["pid"]
            for r in ledger_rows(ledgers["ray"], "SELECT meta_json FROM runs WHERE kind = 'campaign-run'")]
    assert len(set(pids)) == 4, pids


def _lighter(base: Path) -> None:
    """Smaller updates for the tests that are about where runs go, not what they learn."""
    spec = yaml.safe_load(base.read_text())
    spec["train"].update(micro_batch_size=4, grad_accum_steps=1)
    base.write_text(yaml.safe_dump(spec, sort_keys=False))


UPDATES = 12
# The toy job, through a model factory that stops for good at the model's 9th call on the worker node (the processes
# there carry the "-worker" mark): the run there cannot finish before its node is killed, however slow the machine
# (a race with 40 updates of the demo was lost on a loaded one). Its 3rd call waits out the runner's flush interval
# first, so the updates after it reach the ledger: a stopped row has a last recorded update. On the head it trains on.
STALL_ON_THE_WORKER = f"""
import os
import time

from toy import build_data, build_model as toy_model  # noqa: F401


def build_model(cfg):
    model = toy_model({{k: v for k, v in cfg.items() if k != "factory"}})
    if os.environ.get({MARK!r}, "").endswith("-worker"):
        calls = []

        def stall(module, args):
            calls.append(1)
            if len(calls) == 3:
                time.sleep({FLUSH_EVERY_S + 0.5})
            while len(calls) >= 9:
                time.sleep(1)

        model.register_forward_pre_hook(stall)
    return model
"""


def _stalling_campaign(tmp_path: Path) -> Path:
    return _toy_campaign(tmp_path, "stall", STALL_ON_THE_WORKER, seeds=[1], updates=UPDATES,
                         eval={"every": UPDATES // 2}, stop={"non_finite": True, "budget_minutes": 20},
                         keep={"checkpoint": False, "export": False, "control_set": 0})


def _start_node(args: list[str], env: dict) -> str:
    res = subprocess.run([RAY, "start", *args, "--num-cpus=1", "--object-store-memory=80000000",
                          "--node-ip-address=127.0.0.1", "--disable-usage-stats"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.process
def test_a_killed_worker_node_leaves_a_stopped_row_and_every_other_row(tmp_path, ray_env):
    head_env = {**ray_env, MARK: ray_env[MARK]}
    _start_node(["--head", "--port=0", "--include-dashboard=false"], head_env)
    port = (Path(ray_env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster").read_text().strip().rsplit(":", 1)[1]
    address = f"127.0.0.1:{port}"
    worker_mark = ray_env[MARK] + "-worker"
    try:
        _start_node([f"--address={address}"], {**ray_env, MARK: worker_mark})
        spec = _stalling_campaign(tmp_path)
        ledger = tmp_path / "l.sqlite"
        proc = subprocess.Popen([sys.executable, "-m", "pilotrun", "campaign", str(spec), "--engine", "ray",
                                 "--address", address, "--ledger", str(ledger), "--out", str(tmp_path / "runs"),
                                 "--json"], cwd=tmp_path, env={**os.environ, **ray_env,
                                                              "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            victim = None
            deadline = time.monotonic() + 180
            while victim is None and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.3)
                for r in polled_rows(ledger, "SELECT run_id, meta_json FROM runs WHERE kind = 'campaign-run'"):
                    pid = (json.loads(r["meta_json"]).get("ray") or {}).get("pid")
                    on_worker = pid and any(p.pid == pid for p in _marked(worker_mark))
                    if on_worker and ledger_rows(ledger, "SELECT 1 FROM metrics WHERE run_id = ? AND gate = 'train'",
                                                 r["run_id"]):
                        victim = r["run_id"]
            assert victim, "no run recorded an update on the worker node"
            nodes = {json.loads(r["meta_json"])["ray"]["node_id"] for r in
                     ledger_rows(ledger, "SELECT meta_json FROM runs WHERE kind = 'campaign-run'")
                     if json.loads(r["meta_json"]).get("ray")}
            assert len(nodes) == 2, "the runs did not land on both nodes"
            _kill(worker_mark)  # the node's raylet and its workers, with no chance to record anything
            out, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, out + err
        rows = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign-run' ORDER BY rowid")
        assert len(rows) == 2
        for r in rows:
            meta = json.loads(r["meta_json"])
            last = ledger_rows(ledger, "SELECT MAX(step) AS s FROM metrics WHERE run_id = ? AND gate = 'train'",
                               r["run_id"])[0]["s"]
            if r["run_id"] == victim:
                assert (r["status"], meta["stop_kind"]) == ("stopped", "worker-lost"), meta
                assert meta["stopped_at"] == last >= 1
                assert meta["stop_reason"].startswith("the Ray worker running it was lost (")
                assert meta["stop_reason"].endswith(f"the last update this run recorded is {last}")
            else:
                assert r["status"] == "finished" and last == UPDATES, (r["status"], meta)
        camp = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign'")[0]
        assert camp["status"] == "finished-with-stops"
        assert json.loads(out)["conclusion"]["text"], out[:3000]
        # --resume runs the lost run again, on what is left of the cluster, as a new run linked to it.
        res = pilotrun_cli("campaign", camp["run_id"], "--resume", "--engine", "ray", "--address", address,
                           "--ledger", str(ledger), cwd=tmp_path, env=ray_env, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        rows = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign-run' ORDER BY rowid")
        assert len(rows) == 3 and rows[2]["status"] == "finished", rows[2]
        assert json.loads(rows[2]["meta_json"])["continues"] == victim
    finally:
        _kill(worker_mark)


@pytest.mark.process
def test_a_distributed_run_is_a_two_rank_group_inside_one_ray_task_with_rows_per_rank(tmp_path, ray_env):
    spec = _campaign(tmp_path, seeds=[1], vary={"train.optimizer.lr": [1.0e-2, 3.0e-3]}, updates=4,
                     eval={"every": 2}, processes=2, keep={"checkpoint": False, "export": True, "control_set": 2})
    base = tmp_path / "toy" / "pilot.yaml"
    _lighter(base)
    base.write_text(base.read_text() + "\ndistributed: {strategy: ddp}\n")
    ledger = tmp_path / "l.sqlite"
    scratch = Path(ray_env["RAY_TMPDIR"])  # also the processes' temporary folder: torchrun's leftovers show here
    res = pilotrun_cli("campaign", str(spec), "--engine", "ray", "--ledger", str(ledger), "--out",
                       str(tmp_path / "runs"), "--json", cwd=tmp_path, env={**ray_env, "TMPDIR": str(scratch)},
                       timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not list(scratch.glob("torchelastic_*"))
    out = json.loads(res.stdout)
    assert out["parallel"]["resources"] == {"num_cpus": 2, "num_gpus": 0}  # a CPU per rank on a CPU-only machine
    for r in ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign-run'"):
        assert r["status"] == "finished", r["meta_json"]
        by_rank = ledger_rows(ledger, "SELECT gate, rank, COUNT(*) AS n FROM metrics WHERE run_id = ? "
                                      "GROUP BY gate, rank ORDER BY gate, rank", r["run_id"])
        # Each rank writes its own update points (as `pilotrun launch` writes a row per rank); validation is rank 0's.
        assert [(m["gate"], m["rank"], m["n"]) for m in by_rank] == [("train", 0, 4), ("train", 1, 4), ("val", 0, 2)]
        losses = ledger_rows(ledger, "SELECT rank, loss FROM metrics WHERE run_id = ? AND gate = 'train' "
                                     "ORDER BY step, rank", r["run_id"])
        assert losses[0]["loss"] == losses[1]["loss"]  # the update's loss is reduced over the group
        assert (Path(r["out_dir"]) / "export").is_dir() and (Path(r["out_dir"]) / "spool" / "rank1.jsonl").is_file()
        assert len(list((Path(r["out_dir"]) / "torchrun").iterdir())) == 1  # torchrun's own folder, in the run's
    # The local engine runs such a group too (tests/campaign/test_campaign_multigpu.py); a single-process strategy cannot.
    base.write_text(base.read_text().replace("distributed: {strategy: ddp}", ""))
    res = pilotrun_cli("campaign", str(spec), "--engine", "ray", "--ledger", str(tmp_path / "local.sqlite"),
                       cwd=tmp_path, env=ray_env)
    assert res.returncode == 2 and "distributed.strategy is single: set it to ddp or fsdp" in res.stderr, res.stderr



@pytest.mark.process
def test_a_program_campaign_on_ray_keeps_every_row_and_stops_the_diverging_runs_at_their_update(tmp_path, ray_env):
    """Issue 20: the base is the user's program; a diverging lr is stopped by should_stop at the update that broke the
    rule, as on the local engine (test_campaign_program.py)."""
    from tests.campaign.test_campaign_program import RESUMABLE

    (tmp_path / "prog").mkdir()
    (tmp_path / "prog" / "train.py").write_text(RESUMABLE)  # a regression with its own checkpoints, every 4 updates
    (tmp_path / "prog" / "pilot.yaml").write_text(yaml.safe_dump({"name": "prog",
                                                                  "program": {"command": "python train.py"}}))
    spec = tmp_path / "prog-lr.yaml"
    spec.write_text(yaml.safe_dump({"name": "prog-lr", "base": "prog/pilot.yaml", "vary": {"lr": [0.01, 3.0]},
                                    "seeds": [1], "updates": 8, "stop": {"divergence": 3.0},
                                    "program": {"args": ["--lr", "{value}", "--seed", "{seed}", "--updates",
                                                         "{updates}"]}}, sort_keys=False))
    ledger = tmp_path / "ray.sqlite"
    res = pilotrun_cli("campaign", str(spec), "--engine", "ray", "--parallel", "2", "--ledger", str(ledger),
                       "--out", str(tmp_path / "runs"), "--json", cwd=tmp_path, env=ray_env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rows, text = _summary(ledger)
    # The local engine's rows for this campaign (tests/campaign/test_campaign_program.py runs programs there): the program is
    # deterministic, so the rows are known: lr 3.0 breaks the 3x rule at its second update (SGD on this regression
    # overshoots), and the handle's should_stop stops it exactly there.
    # Two runs (the grid and its seeds are the local engine's tests'; two ranks per run: test_campaign_multigpu.py).
    assert [r[1:5] for r in rows] == [(0.01, 1, "finished", None), (3.0, 1, "diverged", "divergence")], rows
    assert all(r[6] == r[8] == r[7] == 2 for r in rows if r[3] == "diverged")  # stopped where its last point is
    assert all(r[7] == 8 for r in rows if r[3] == "finished")
    assert any("lr = 3.0 diverged in 1 of 1" in t for t in text), text
    assert not _marked(ray_env[MARK]), "the campaign left Ray processes behind"
