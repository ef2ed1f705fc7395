"""The task `pilotrun plan --skypilot` writes, as SkyPilot itself reads it, and its run script as a restarted task
runs it: twice on a local folder standing in for the bucket, the first one SIGKILLed mid-campaign.

SkyPilot lives in a venv of its own (the Makefile's .venv-skypilot: its click<8.2 would downgrade huggingface_hub and
transformers in the dev venv); ``$PILOTRUN_SKYPILOT_PYTHON`` names its interpreter. The parser runs there with HOME
and SkyPilot's config files in a temp folder and every socket connect refused: it never reaches a cloud."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import EXAMPLES, FIXTURES, REPO, TEST_DIGEST, ledger_rows, pilotrun_cli, polled_rows

pytestmark = pytest.mark.process

SHALLOW = "model.config.num_hidden_layers=4"  # the 7B example's shape, 4 layers deep: a trace in seconds
SLOW = """

import os as _os
import time as _time

_forward = BagClassifier.forward


def _slow_forward(self, *args, **kwargs):
    _time.sleep(float(_os.environ.get("TOY_SECONDS_PER_FORWARD", "0")))
    return _forward(self, *args, **kwargs)


BagClassifier.forward = _slow_forward
"""
PARSE = r"""
import json, socket, sys

def refused(*args, **kwargs):
    raise OSError("the parser test refuses every connection: SkyPilot must not reach a cloud to read a task")

socket.socket.connect = refused
socket.socket.connect_ex = refused
import sky

out = {}
for path in sys.argv[1:]:
    t = sky.Task.from_yaml(path)
    (r,) = list(t.resources)
    out[path] = {"name": t.name, "num_nodes": t.num_nodes, "accelerators": r.accelerators, "use_spot": r.use_spot,
                 "disk_size": r.disk_size, "image_id": r.image_id, "setup": t.setup, "run": t.run,
                 "envs": dict(t.envs), "workdir": t.workdir, "file_mounts": dict(t.file_mounts or {}),
                 "storage": {k: [v.name, v.source, v.mode.value] for k, v in (t.storage_mounts or {}).items()}}
print(json.dumps(out, default=str))
"""


def sky_python() -> str:
    py = os.environ.get("PILOTRUN_SKYPILOT_PYTHON") or str(REPO / ".venv-skypilot" / "bin" / "python")
    if not Path(py).is_file():
        pytest.fail(f"no SkyPilot interpreter at {py}: `make skypilot-venv` builds it (make test does), or set "
                    "PILOTRUN_SKYPILOT_PYTHON to a python with skypilot==0.14.1")
    return py


def parse_with_skypilot(tmp_path: Path, *tasks: Path) -> dict:
    home = tmp_path / "sky-home"
    home.mkdir(exist_ok=True)
    for name in ("global.yaml", "project.yaml"):
        (home / name).write_text("{}\n")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
           "SKYPILOT_GLOBAL_CONFIG": str(home / "global.yaml"), "SKYPILOT_PROJECT_CONFIG": str(home / "project.yaml")}
    res = subprocess.run([sky_python(), "-c", PARSE, *map(str, tasks)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return {Path(k).name: v for k, v in json.loads(res.stdout.splitlines()[-1]).items()}


def _toy_job(tmp_path: Path, updates: int = 2) -> tuple[Path, Path]:
    """The toy job (its workers start without transformers) with a short pilot, and a two-run campaign on it, in the
    spec's folder (the task's workdir)."""
    root = tmp_path / "job"
    shutil.copytree(FIXTURES / "toy", root / "toy", ignore=shutil.ignore_patterns("__pycache__"))
    spec = root / "toy" / "pilot.yaml"
    with open(root / "toy" / "toy.py", "a") as fh:  # a node as slow as the test needs to kill it mid-run
        fh.write(SLOW)
    body = yaml.safe_load(spec.read_text())
    body["pilot"] = {**body.get("pilot", {}), "gates": ["lock", "load", "first_step"]}
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    campaign = root / "toy" / "sweep.yaml"
    campaign.write_text(yaml.safe_dump({
        "name": "sweep", "base": "pilot.yaml", "vary": {"train.optimizer.lr": [3.0e-3, 1.0e-3]}, "seeds": [1],
        "updates": updates, "eval": {"every": max(1, updates // 4)},
        "stop": {"non_finite": True, "divergence": 50.0, "budget_minutes": 20},
        "keep": {"checkpoint": False, "export": False, "control_set": 0}}, sort_keys=False))
    return spec, campaign


def test_every_generated_task_loads_with_skypilots_parser(tmp_path):
    seven_b = tmp_path / "7b.yaml"
    # Its data in a bucket (issue 47, item 5): the bucket folder is copied onto the node; the tokenizer stays local.
    res = pilotrun_cli("plan", str(EXAMPLES / "llama-7b-estimate" / "pilot.yaml"), "--set", SHALLOW, "--set",
                       "data.path=s3://team-data/sft/train.jsonl", "--accelerator",
                       "H100-80GB", "--spot", "--skypilot", str(seven_b), "--bucket", "s3://team-runs/llama",
                       "--long-run", 'torchrun --nproc-per-node 1 train.py --checkpoints "$PILOTRUN_BUCKET/ckpt"',
                       cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    spec, campaign = _toy_job(tmp_path)
    cpu = tmp_path / "toy-task.yaml"  # on this CPU machine, no prices: the task still holds, saying what is unknown
    res = pilotrun_cli("plan", str(spec), "--accelerator", "L4-24GB", "--skypilot", str(cpu), "--campaign",
                       str(campaign), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    sharded = tmp_path / "fsdp4.yaml"  # the task a sharded plan gives: 4 GPUs, launch, the campaign on Ray, an image
    from pilotrun.deploy.skypilot import task_text
    from tests.deploy.test_deploy import inputs, lock

    digest = "ghcr.io/org/train@sha256:" + "ab" * 32
    with_image = lock() | {"container": {"digest": digest, "from": "--container-digest"}}
    sharded.write_text(task_text(inputs(lock=with_image)))
    two_nodes = tmp_path / "two-nodes.yaml"  # a plan over 2 nodes of 8 (tests/deploy/test_skypilot_multinode.py runs it)
    two_nodes.write_text(task_text(inputs(row=inputs().row | {"gpus": 16})))  # with its campaign over both nodes
    tasks = parse_with_skypilot(tmp_path, seven_b, cpu, sharded, two_nodes)
    t = tasks["two-nodes.yaml"]
    assert t["num_nodes"] == 2 and t["accelerators"] == {"H100": 8} and t["envs"]["PILOTRUN_RDZV_PORT"] == "29500"
    assert '--nnodes "$NNODES" --node-rank "$NODE" --rdzv-endpoint "$RDZV"' in t["run"]
    assert '-m pilotrun campaign "$WORKDIR/job/sweep.yaml" --task-id "$TASK" --nnodes "$NNODES"' in t["run"]

    t = tasks["7b.yaml"]
    assert t["accelerators"] == {"H100": 1} and t["use_spot"] is True and t["num_nodes"] == 1
    assert t["storage"] == {"/pilotrun-bucket": [None, "s3://team-runs/llama", "MOUNT_CACHED"]}
    assert t["workdir"] == str(EXAMPLES / "llama-7b-estimate")  # the spec's folder, never the parent of its files
    assert t["envs"]["PILOTRUN_LEDGER"] == "/pilotrun-bucket/ledger.sqlite"
    # its ../tiny-sft tokenizer, mounted alone where ~/sky_workdir/../tiny-sft reaches on the node; its data, in a
    # bucket, copied by folder and found through $PILOTRUN_DATA_MOUNTS
    assert t["file_mounts"]["~/tiny-sft/tokenizer"] == str(EXAMPLES / "tiny-sft" / "tokenizer")
    assert t["file_mounts"]["/pilotrun-data/0"] == "s3://team-data/sft" and "~/tiny-sft/data.jsonl" not in t["file_mounts"]
    assert json.loads(t["envs"]["PILOTRUN_DATA_MOUNTS"]) == {"s3://team-data/sft": "/pilotrun-data/0"}
    assert "The data it proves: s3://team-data/sft" in t["run"]
    assert "not counted: data: unknown (the data copied from s3://team-data/sft, whose size" in seven_b.read_text()
    lock = json.loads((tmp_path / "7b.lock.json").read_text())
    assert t["file_mounts"]["/pilotrun/proven-lock.json"] == str(tmp_path / "7b.lock.json")
    for name in ("transformers", "numpy", "safetensors", "peft"):  # every distribution at the lock's version
        assert f"\n{name}=={lock['distributions'][name]}\n" in t["setup"], name
    torch_base = lock["versions"]["torch"].split("+")[0]
    assert f"\ntorch=={torch_base}\n" in t["setup"] and "-m pilotrun lock check" in t["setup"]
    run = t["run"]
    pilot = run.index('-m pilotrun run "$WORKDIR/pilot.yaml" --task-id "$TASK"')
    assert pilot < run.index("torchrun --nproc-per-node 1 train.py"), run
    text = seven_b.read_text()
    assert "(spot: " in text and "cost unknown: no price for H100-80GB" in text and "image_id: unknown" in text

    t = tasks["toy-task.yaml"]
    assert t["accelerators"] == {"L4": 1} and t["use_spot"] is False and t["image_id"] is None
    assert t["storage"] == {"/pilotrun-bucket": ["pilotrun-toy", None, "MOUNT_CACHED"]}
    assert '-m pilotrun campaign "$WORKDIR/sweep.yaml" --task-id "$TASK" --parallel 1' in t["run"]
    text = cpu.read_text()
    assert "no --bucket: SkyPilot creates a bucket of this name" in text and "cost unknown" in text

    t = tasks["fsdp4.yaml"]
    assert t["accelerators"] == {"H100": 4} and t["image_id"] == {"null": f"docker:{digest}"}  # JSON of {None: image}: any region
    assert t["disk_size"] == 60 + 5 * 80 + 13 + 2 and t["storage"]["/pilotrun-bucket"] == ["my-runs", None,
                                                                                          "MOUNT_CACHED"]
    assert '-m pilotrun launch --nproc-per-node 4' in t["run"] and "--engine ray" in t["run"]


def _points(ledger: Path) -> int:
    return len(polled_rows(ledger, "SELECT 1 FROM metrics WHERE gate = 'train'"))


def test_the_run_script_resumes_a_killed_campaign_without_a_lost_or_duplicated_row(tmp_path):
    """What `sky jobs launch` does after a preemption: the same run script again, on a new node, with the bucket."""
    spec, campaign = _toy_job(tmp_path, updates=40)
    task_file = tmp_path / "task.yaml"
    res = pilotrun_cli("plan", str(spec), "--accelerator", "L4-24GB", "--skypilot", str(task_file), "--campaign",
                       str(campaign), "--bucket", "test-runs", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    run = yaml.safe_load(task_file.read_text())["run"]
    bucket = tmp_path / "bucket"  # the bucket's local stand-in
    ledger = bucket / "ledger.sqlite"
    env = {**os.environ, "PILOTRUN_BUCKET": str(bucket), "PILOTRUN_LEDGER": str(ledger),
           "PILOTRUN_PROVEN_LOCK": str(tmp_path / "task.lock.json"), "PILOTRUN_PYTHON": sys.executable,
           "SKYPILOT_TASK_ID": "sky-managed-2026-12-02-0001_pilotrun-toy_1-0", "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST,
           "COLUMNS": "200"}

    def script(seconds_per_forward: float = 0.0) -> subprocess.Popen:
        return subprocess.Popen(["bash", "-c", run], cwd=tmp_path / "job" / "toy", text=True, start_new_session=True,
                                env={**env, "TOY_SECONDS_PER_FORWARD": str(seconds_per_forward)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    first = script(seconds_per_forward=0.05)  # 0.1 s an update: the kill lands inside the first run
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and _points(ledger) < 1:  # the campaign's first run is training
            time.sleep(0.2)
            if first.poll() is not None:
                pytest.fail(f"the run script ended ({first.returncode}) before the campaign trained:\n"
                            f"{first.stdout.read() if first.stdout else ''}")
        assert _points(ledger) >= 1, "the campaign never trained"
        tree = psutil.Process(first.pid).children(recursive=True)
        os.killpg(first.pid, signal.SIGKILL)  # the node is gone: nothing records anything
        first.wait(timeout=30)
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"left running: {[p.cmdline()[-6:] for p in alive]}"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    camp = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign'")
    assert [c["status"] for c in camp] == ["running"]  # as a preemption leaves it

    second = script()  # the restarted node, at full speed
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out
    assert "not run again" in out and "was cut short: continued its 2 stopped or not-run run(s)" in out, out

    pilots = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'pilot'")
    assert [p["status"] for p in pilots] == ["pass"], pilots  # piloted once, on the first start
    gate = ledger_rows(ledger, "SELECT reason FROM gate_rows WHERE run_id = ? AND gate = 'lock'", pilots[0]["run_id"])
    assert "the proven lock" in gate[0]["reason"], gate
    runs = ledger_rows(ledger, "SELECT * FROM runs WHERE kind = 'campaign-run' ORDER BY run_id")
    cid = camp[0]["run_id"]
    assert [(r["run_id"][len(cid):], r["status"], (r["parent_id"] or "")[len(cid):]) for r in runs] == [
        ("-r01", "stopped", ""), ("-r02", "not-run", ""), ("-r03", "finished", "-r01"), ("-r04", "finished", "-r02")]
    stopped = json.loads(runs[0]["meta_json"])
    steps = [m["step"] for m in ledger_rows(ledger, "SELECT step FROM metrics WHERE run_id = ? AND gate = 'train' "
                                                    "ORDER BY step", runs[0]["run_id"])]
    assert steps == list(range(1, stopped["stopped_at"] + 1)) and 1 <= stopped["stopped_at"] < 40  # kept, once each
    assert "restarted on another machine" in stopped["stop_reason"] or "was killed" in stopped["stop_reason"]
    pairs = [(json.loads(r["meta_json"])["variant"], json.loads(r["meta_json"])["seed"]) for r in runs
             if r["status"] == "finished"]
    assert sorted(pairs) == [(1.0e-3, 1), (3.0e-3, 1)]  # every declared run has its one result
    assert ledger_rows(ledger, "SELECT status FROM runs WHERE run_id = ?", cid)[0]["status"] == "finished"

    third = script()  # a third start (a recovery after the end): nothing runs, nothing is added
    out, _ = third.communicate(timeout=300)
    assert third.returncode == 0 and "has ended (finished): nothing to run" in out, out
    assert len(ledger_rows(ledger, "SELECT run_id FROM runs")) == 1 + 1 + 4


# -- no shell from data: hostile names and values reach the node as data, or are refused naming the field ----------

# A spec file name that is a shell program in every quoting context: $(...), backticks, quotes, ;, #, a newline.
HOSTILE_SPEC = "toy $(touch pwned-dollar)`touch pwned-tick`'\"; touch pwned-semi #\n$(touch pwned-newline).yaml"
HOSTILE_CAMPAIGN = "sweep `touch pwned-campaign`'$(touch pwned-campaign2)'.yaml"
STUB = """#!{python}
import json, os, sys
name = os.path.basename(sys.argv[0])
with open(os.environ["STUB_LOG"], "a") as fh:
    fh.write(json.dumps([name, *sys.argv[1:]]) + "\\n")
if name == "uv":  # `uv venv ... VENV`: the venv's python is this stub too
    os.makedirs(os.path.join(sys.argv[-1], "bin"), exist_ok=True)
    os.symlink(os.path.realpath(sys.argv[0]), os.path.join(sys.argv[-1], "bin", "python"))
"""


def _stubs(tmp_path: Path) -> tuple[Path, Path]:
    """A folder of commands (python3, uv) that only record their arguments, one JSON list a line, in the log."""
    bin_dir, log = tmp_path / "stub-bin", tmp_path / "stub.log"
    bin_dir.mkdir()
    stub = tmp_path / "stub.py"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    for name in ("python3", "uv"):
        (bin_dir / name).symlink_to(stub)
    return bin_dir, log


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _hostile_setup_task(tmp_path: Path) -> tuple[Path, str]:
    """A task whose lock source, pilotrun source and requirement carry a heredoc end, shell and a pip option."""
    from pilotrun.deploy.requirements import Target, requirements
    from pilotrun.deploy.skypilot import PilotrunSource, task_text
    from tests.deploy.test_deploy import inputs, lock

    evil = ("pilot p1\nPILOTRUN_REQUIREMENTS\ntouch pwned-heredoc\n--index-url http://evil\u2028touch pwned-u2028\r"
            "touch pwned-cr")
    req = requirements(lock(), Target.CUDA, evil)
    source = PilotrunSource(None, "pilotrun @ git+https://example.com/p.git@abc; touch pwned-req",
                            "from $(touch pwned-why)\ntouch pwned-why2")
    task = tmp_path / "setup-task.yaml"
    task.write_text(task_text(inputs(lock_from=evil, requirements=req, source=source, campaign=None, overrides=[])))
    return task, req.text


def test_no_name_or_value_runs_as_shell_on_the_node(tmp_path):
    """The spec and campaign files named as shell programs, a data file outside the spec's folder, and hostile
    values in the setup: the task SkyPilot reads runs each name as a name and writes the lock as pins only."""
    spec, _ = _toy_job(tmp_path)
    body = yaml.safe_load(spec.read_text())
    body["data"]["path"] = "../../data/d.jsonl"  # beside the job: mounted alone, not a reason to upload job/..
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "d.jsonl").write_text("{}\n")
    workdir = spec.parent
    (workdir / HOSTILE_SPEC).write_text(yaml.safe_dump(body, sort_keys=False))
    spec.unlink()
    campaign = workdir / HOSTILE_CAMPAIGN
    (workdir / "sweep.yaml").rename(campaign)
    campaign.write_text(campaign.read_text().replace("base: pilot.yaml", f"base: {json.dumps(HOSTILE_SPEC)}"))
    task = tmp_path / "task.yaml"
    res = pilotrun_cli("plan", HOSTILE_SPEC, "--accelerator", "L4-24GB", "--skypilot", str(task), "--campaign",
                       HOSTILE_CAMPAIGN, cwd=workdir)
    assert res.returncode == 2 and "data.path: ../../data/d.jsonl is outside the spec's folder" in res.stderr, (
        res.stdout + res.stderr)  # ../.. from ~/sky_workdir is above the node's home folder: refused, not guessed
    body["data"]["path"] = "../data/d.jsonl"
    (workdir / HOSTILE_SPEC).write_text(yaml.safe_dump(body, sort_keys=False))
    (workdir.parent / "data").mkdir()
    (workdir.parent / "data" / "d.jsonl").write_text("{}\n")
    res = pilotrun_cli("plan", HOSTILE_SPEC, "--accelerator", "L4-24GB", "--skypilot", str(task), "--campaign",
                       HOSTILE_CAMPAIGN, cwd=workdir)
    assert res.returncode == 0, res.stdout + res.stderr
    setup_task, requirements_text = _hostile_setup_task(tmp_path)
    tasks = parse_with_skypilot(tmp_path, task, setup_task)

    t = tasks["task.yaml"]
    assert t["workdir"] == str(workdir)
    assert t["file_mounts"]["~/data/d.jsonl"] == str(workdir.parent / "data" / "d.jsonl")
    bin_dir, log = _stubs(tmp_path)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path / "node-home"), "STUB_LOG": str(log),
           "PILOTRUN_PYTHON": str(bin_dir / "python3"), "PILOTRUN_BUCKET": str(tmp_path / "bucket"),
           "PILOTRUN_PROVEN_LOCK": "/x/lock.json", "SKYPILOT_TASK_ID": "t-1"}
    res = subprocess.run(["bash", "-c", t["run"]], cwd=workdir, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    pilot, camp = _calls(log)
    assert pilot[1:5] == ["-m", "pilotrun", "run", str(workdir / HOSTILE_SPEC)], pilot
    assert camp[1:5] == ["-m", "pilotrun", "campaign", str(workdir / HOSTILE_CAMPAIGN)], camp

    log.unlink()
    home = tmp_path / "node-home"
    res = subprocess.run(["bash", "-c", tasks["setup-task.yaml"]["setup"]], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    written = (home / ".pilotrun" / "requirements.lock.txt").read_text()
    assert written == requirements_text  # the heredoc holds the file whole, ended by its own line only
    assert not [line for line in written.splitlines() if line and not line.startswith("#") and "==" not in line]
    venv = str(home / "pilotrun-venv")
    assert _calls(log)[1:] == [
        ["uv", "venv", "--allow-existing", "--seed", "--python", "3.11.7", venv],
        ["python", "-m", "pip", "install", "--quiet", "-r", str(home / ".pilotrun" / "requirements.lock.txt")],
        ["python", "-m", "pip", "install", "--quiet", "--no-deps",
         "pilotrun @ git+https://example.com/p.git@abc; touch pwned-req"],
        ["python", "-m", "pilotrun", "lock", "check", str(home / ".pilotrun" / "requirements.lock.txt")]]
    assert not list(tmp_path.rglob("pwned*")), "a name or a value ran as a command"


def test_hostile_lock_values_and_paths_out_of_the_workdir_are_refused_naming_them(tmp_path):
    from tests.deploy.test_deploy import lock

    spec, campaign = _toy_job(tmp_path)
    evil = lock()
    evil["versions"]["python"] = "3.11.7\nPILOTRUN_REQUIREMENTS\ntouch pwned"  # would close the setup's heredoc
    (tmp_path / "evil.lock.json").write_text(json.dumps(evil))
    task = tmp_path / "t.yaml"
    res = pilotrun_cli("plan", str(spec), "--accelerator", "L4-24GB", "--skypilot", str(task), "--lock",
                       str(tmp_path / "evil.lock.json"), cwd=tmp_path)
    assert res.returncode == 2 and "the lock's versions.python is '3.11.7\\nPILOTRUN_REQUIREMENTS" in res.stderr, (
        res.stderr)
    evil["versions"]["python"] = "3.11; rm -rf ~"
    (tmp_path / "evil.lock.json").write_text(json.dumps(evil))
    res = pilotrun_cli("plan", str(spec), "--accelerator", "L4-24GB", "--skypilot", str(task), "--lock",
                       str(tmp_path / "evil.lock.json"), cwd=tmp_path)
    assert res.returncode == 2 and "versions.python is '3.11; rm -rf ~', not a python version" in res.stderr
    outside = tmp_path / "job" / "sweep.yaml"  # a campaign beside the spec's folder: its base is not in the workdir
    outside.write_text(campaign.read_text().replace("base: pilot.yaml", "base: toy/pilot.yaml"))
    res = pilotrun_cli("plan", str(spec), "--accelerator", "L4-24GB", "--skypilot", str(task), "--campaign",
                       str(outside), cwd=tmp_path)
    assert res.returncode == 2 and f"--campaign {outside} is outside the spec's folder" in res.stderr, res.stderr
    body = yaml.safe_load(spec.read_text())
    body["data"]["path"] = "../da~ta/d.jsonl"  # SkyPilot would read the ~ of its destination as the home folder
    spec.write_text(yaml.safe_dump(body, sort_keys=False))
    res = pilotrun_cli("plan", str(spec), "--accelerator", "L4-24GB", "--skypilot", str(task), cwd=tmp_path)
    assert res.returncode == 2 and "data.path: ../da~ta/d.jsonl is outside the spec's folder" in res.stderr
    assert "its path holds a ~" in res.stderr and not task.exists() and not list(tmp_path.rglob("pwned*"))
