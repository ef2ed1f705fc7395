"""The rented node, pure parts: the lock as a requirements file, the SkyPilot task as text, the device's build told
apart from drift, what a restarted task does with its pilot, the expected spot recovery, and the CLI's refusals.

SkyPilot's own parser loading the generated tasks, and the run script resuming a SIGKILLed campaign, are in
tests/deploy/test_skypilot.py (they start processes)."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from pilotrun.deploy.requirements import (
    Difference,
    NoTorchIndex,
    Requirements,
    Target,
    Unpinnable,
    check,
    parse,
    python_of,
    requirements,
)
from pilotrun.deploy.skypilot import (
    Bucket,
    CampaignPart,
    Mount,
    PilotrunSource,
    Size,
    TaskInputs,
    TaskRefused,
    bucket_problem,
    image_id,
    task_text,
)
from pilotrun.estimate.catalog import CatalogError, load_catalog
from pilotrun.estimate.plan import Assumptions, Item, recovery_item
from pilotrun.lock import DriftKind, classify_drift, diff_locks
from pilotrun.pilot.recovery import Recovery, pilot_recovery
from tests.conftest import EXAMPLES, pilotrun_cli

GB = 10**9


def lock(torch="2.13.0+cpu", cuda=None, hip=None, **dists) -> dict:
    return {"versions": {"python": "3.11.7", "torch": torch, "cuda": cuda, "hip": hip, "cudnn": None, "nccl": None},
            "distributions": {"torch": torch, "numpy": "2.4.6", "transformers": "5.1.0", "pilotrun": "0.1.0", **dists},
            "container": {"digest": None, "from": None, "inside_container": False}, "config_hash": "h"}


# -- the lock as a requirements file --------------------------------------------------------------------------------

def test_a_cpu_lock_for_a_cuda_node_pins_every_version_and_takes_torchs_default_cuda_build_from_pypi():
    req = requirements(lock(torchvision="0.28.0+cpu"), Target.CUDA, "pilot p1")
    assert req.pins == {"torch": "2.13.0", "torchvision": "0.28.0", "numpy": "2.4.6", "transformers": "5.1.0"}
    assert req.index is None and "--extra-index-url" not in req.text and "PyPI" in req.torch_from
    assert python_of(req.text) == "3.11.7" and "pilot p1" in req.text.splitlines()[0]
    assert any(x.startswith("pilotrun 0.1.0: installed from its source") for x in req.left_out)


def test_a_lock_proven_on_cuda_keeps_its_index_and_leaves_the_runtime_wheels_to_torch():
    proven = lock("2.13.0+cu128", cuda="12.8", **{"nvidia-cublas-cu12": "12.8.4.1", "triton": "3.6.0"})
    req = requirements(proven, Target.CUDA, "pilot p2")
    assert req.index == "https://download.pytorch.org/whl/cu128" and f"--extra-index-url {req.index}" in req.text
    assert req.pins["torch"] == "2.13.0+cu128" and "nvidia-cublas-cu12" not in req.pins and "triton" not in req.pins
    assert {x.split(":")[0] for x in req.left_out} >= {"nvidia-cublas-cu12 12.8.4.1", "triton 3.6.0"}


def test_rocm_needs_the_index_unless_the_lock_ran_on_rocm():
    with pytest.raises(NoTorchIndex, match="--torch-index https://download.pytorch.org/whl/rocm"):
        requirements(lock(), Target.ROCM, "p")
    req = requirements(lock(), Target.ROCM, "p", index="https://download.pytorch.org/whl/rocm6.4")
    assert req.pins["torch"] == "2.13.0+rocm6.4" and req.index.endswith("rocm6.4")
    cpu = requirements(lock("2.13.0"), Target.CPU, "p")
    assert cpu.pins["torch"] == "2.13.0" and cpu.index is None  # the same build as proven: PyPI's


def test_check_names_each_pin_the_environment_does_not_hold_and_the_python():
    req = requirements(lock(), Target.CPU, "p")
    assert parse(req.text)["torch"] == "2.13.0+cpu" and req.index == "https://download.pytorch.org/whl/cpu"
    installed = {"torch": "2.13.0+cpu", "numpy": "2.4.6", "transformers": "5.2.0", "extra-lib": "1"}
    problems = check(req.pins, installed, python_of(req.text), "3.12.1")
    assert [str(p) for p in problems] == ["python: pinned 3.11.7, installed 3.12.1",
                                          "transformers: pinned 5.1.0, installed 5.2.0"]
    assert [p.kind for p in problems] == [Difference.PYTHON, Difference.PIN]  # python is no pin: counted apart
    assert [str(p) for p in check({"peft": "0.18.0"}, {})] == ["peft: pinned 0.18.0, not installed"]


# -- no value of a lock becomes a pip option, a shell command or the end of a heredoc ---------------------------------

def _with(path: str, value) -> dict:
    out = lock()
    *parents, key = path.split(".")
    node = out
    for part in parents:
        node = node[part]
    node[key] = value
    return out


@pytest.mark.parametrize("field, value, said", [
    ("distributions.numpy", "--index-url http://evil", "distributions.numpy is '--index-url http://evil', not a PEP 440"),
    ("distributions.numpy", "2.4.6\n--index-url http://evil", "distributions.numpy is '2.4.6\\n--index-url"),
    ("distributions.--index-url http://evil", "1.0", "a name '--index-url http://evil', not a distribution name"),
    ("versions.python", "3.11; rm -rf ~", "versions.python is '3.11; rm -rf ~', not a python version"),
    ("versions.python", "3.11.7\nPILOTRUN_REQUIREMENTS\ntouch x", "versions.python is '3.11.7\\nPILOTRUN_REQUIREMENTS"),
    ("versions.torch", "2.13.0 --trusted-host evil", "versions.torch is '2.13.0 --trusted-host evil', not a PEP 440"),
])
def test_a_lock_value_outside_its_grammar_is_refused_naming_the_field(field, value, said):
    with pytest.raises(Unpinnable, match=re.escape(said)):
        requirements(_with(field, value), Target.CUDA, "evil.json")


def test_a_torch_index_that_would_carry_another_option_is_refused_naming_the_flag():
    with pytest.raises(Unpinnable, match=r"--torch-index 'https://x/whl/cu128 --trusted-host evil' is not an index"):
        requirements(lock(), Target.CUDA, "p", index="https://x/whl/cu128 --trusted-host evil")
    ok = requirements(lock(), Target.ROCM, "p", index="https://download.pytorch.org/whl/rocm6.4")
    assert "--extra-index-url https://download.pytorch.org/whl/rocm6.4" in ok.text.splitlines()


def test_the_requirements_file_is_comments_pins_and_its_index_whatever_the_source_says():
    source = "run x\n--index-url http://evil\rPILOTRUN_REQUIREMENTS\u2028-e git+http://evil\x85y"
    req = requirements(lock("2.13.0+cu128", cuda="12.8"), Target.CUDA, source)
    lines = req.text.splitlines()  # Python's line breaks include \r, \x85 and \u2028: none is left in a line
    assert len(lines) == req.text.count("\n") and "PILOTRUN_REQUIREMENTS" not in lines
    options = [line for line in lines if line.startswith("-")]
    assert options == ["--extra-index-url https://download.pytorch.org/whl/cu128"]
    assert all(line.startswith("#") or line in options or re.fullmatch(r"[a-z0-9-]+==[0-9a-z.+]+", line)
               for line in lines), lines
    assert lines[0] == ("# pilotrun lock export of run x\\n--index-url http://evil\\rPILOTRUN_REQUIREMENTS\\u2028-e "
                        "git+http://evil\\x85y: every distribution at its exact version.")


def test_a_task_refuses_what_yaml_or_skypilots_upload_would_not_keep_as_written():
    hand_made = Requirements("torch==2.13.0\n", "3.11; touch x", "torch==2.13.0", None, "PyPI")
    with pytest.raises(TaskRefused, match=re.escape("versions.python is '3.11; touch x', not a python version")):
        task_text(inputs(requirements=hand_made))
    with pytest.raises(TaskRefused, match=re.escape("the file 'pilot\\r.yaml' (in the workdir) has '\\r' in its name")):
        task_text(inputs(spec_rel="pilot\r.yaml"))
    with pytest.raises(TaskRefused, match=re.escape("the workdir /src/it's$(x) (the spec's folder) holds")):
        task_text(inputs(workdir="/src/it's$(x)"))
    mount = Mount("~/data/d`x`.jsonl", "/src/data/d`x`.jsonl", "data.path: ../data/d`x`.jsonl")
    with pytest.raises(TaskRefused, match=re.escape("data.path: /src/data/d`x`.jsonl holds '`'")):
        task_text(inputs(mounts=[mount]))
    assert bucket_problem("s3://team/$(touch x)") and bucket_problem("s3://team/runs; x") and \
        bucket_problem("s3://team/runs-1/a_b.c") is None
    # a comment keeps a value's line breaks inside it: the YAML still has the keys it had, the note one line
    text = task_text(inputs(notes=["a\u2028name: evil\x85b\rc"], name="job"))
    assert yaml.safe_load(text)["name"] == "pilotrun-job" and "# a\\u2028name: evil\\x85b\\rc" in text


# -- the node's build is not drift -----------------------------------------------------------------------------------

def test_the_same_releases_built_for_another_device_are_the_device_not_drift():
    laptop = lock() | {"data": {"path": "/home/me/job/data.jsonl", "sha256": "x"}}
    node = lock("2.13.0+cu128", cuda="12.8", **{"nvidia-cublas-cu12": "12.8.4.1", "transformers": "5.2.0"}) | {
        "data": {"path": "/root/sky_workdir/job/data.jsonl", "sha256": "x"}}
    node["versions"]["cudnn"] = 91002
    kinds = classify_drift(diff_locks(laptop, node))
    assert {k for k, _, _ in kinds[DriftKind.DEVICE]} == {"versions.torch", "distributions.torch", "versions.cuda",
                                                           "versions.cudnn", "distributions.nvidia-cublas-cu12"}
    assert [k for k, _, _ in kinds[DriftKind.ENVIRONMENT]] == ["distributions.transformers"]  # a real drift
    assert not any(k == "data.path" for items in kinds.values() for k, _, _ in items)  # same content elsewhere
    older = lock("2.13.0+cu124", cuda="12.4")
    kinds = classify_drift(diff_locks(older, lock("2.13.0+cu128", cuda="12.8")))
    assert {k for k, _, _ in kinds[DriftKind.ENVIRONMENT]} == {"versions.torch", "distributions.torch",
                                                                "versions.cuda"} and not kinds[DriftKind.DEVICE]
    moved = classify_drift(diff_locks({"data": {"path": "/a", "sha256": "x"}}, {"data": {"path": "/b", "sha256": "y"}}))
    assert {k for k, _, _ in moved[DriftKind.ENVIRONMENT]} == {"data.path", "data.sha256"}


# -- a restarted task's pilot ----------------------------------------------------------------------------------------

def _run(run_id, status, task="t1", config_hash="h", kind="pilot"):
    return {"run_id": run_id, "kind": kind, "status": status, "config_hash": config_hash,
            "meta_json": json.dumps({"task_id": task} if task else {})}


@pytest.mark.parametrize("runs, action, run_id", [
    ([], Recovery.START, None),
    ([_run("other", "pass", task="t0"), _run("mine-campaign", "running", kind="campaign")], Recovery.START, None),
    ([_run("p2", "warn"), _run("p1", "interrupted")], Recovery.PROVEN, "p2"),
    ([_run("p1", "fail")], Recovery.FAILED, "p1"),
    ([_run("p1", "running")], Recovery.RESUME, "p1"),
    ([_run("p1", "interrupted")], Recovery.RESUME, "p1"),
    ([_run("p1", "pass", config_hash="other")], Recovery.START, None),
])
def test_a_restarted_task_runs_its_pilot_once_and_continues_one_cut_short(runs, action, run_id):
    plan = pilot_recovery(runs, "t1", "h")
    assert (plan.action, plan.run_id) == (action, run_id), plan.reason
    assert "t1" in plan.reason


# -- spot: the expected recovery -------------------------------------------------------------------------------------

def test_the_expected_spot_recovery_is_relaunches_plus_half_a_run_redone():
    a = Assumptions(preemptions_per_day=2.0, relaunch_minutes=30)
    item = recovery_item(48.0, 10.0, a)  # 4 expected preemptions, each 0.5 h + 5 h redone
    assert item["item"] == Item.RECOVERY and item["hours"] == pytest.approx(4 * 5.5)
    assert "--preemptions-per-day" in item["from"] and "half a run's training" in item["from"]
    unknown = recovery_item(24.0, None, a)
    assert unknown["hours"] == pytest.approx(2 * 0.5) and "not counted" in unknown["from"]


def test_spot_costs_use_the_spot_price_or_say_they_fall_back(tmp_path):
    from pilotrun.config.load import load_spec
    from pilotrun.estimate.plan import pipeline_hours
    from tests.estimate.test_estimate import synthetic_trace

    spec = load_spec(EXAMPLES / "llama-7b-estimate" / "pilot.yaml", check_files=False)
    row = {"accelerator": "H100-80GB", "gpus": 2, "price_per_gpu_hour": 3.0, "seconds_per_update": 2.0,
           "utilisation_source": "catalog default", "cost_note": None, "spot_price_per_gpu_hour": 1.0}
    on_demand = pipeline_hours(spec, row, synthetic_trace(), None, None, {"bytes": 0, "reason": "none"})
    spot = pipeline_hours(spec, row, synthetic_trace(), None, None, {"bytes": 0, "reason": "none"}, spot=True)
    rec = next(i for i in spot["items"] if i["item"] == Item.RECOVERY)
    assert spot["hours"] == pytest.approx(on_demand["hours"] + rec["hours"]) and rec["hours"] > 0
    assert spot["cost"] == pytest.approx(spot["hours"] * 2 * 1.0) and spot["cost_note"] is None
    fallback = pipeline_hours(spec, row | {"spot_price_per_gpu_hour": None}, synthetic_trace(), None, None,
                              {"bytes": 0, "reason": "none"}, spot=True)
    assert fallback["cost"] == pytest.approx(fallback["hours"] * 2 * 3.0)
    assert "no spot price for H100-80GB" in fallback["cost_note"]
    assert not any(i["item"] == Item.RECOVERY for i in on_demand["items"])


# -- the task as text ------------------------------------------------------------------------------------------------

def inputs(**over) -> TaskInputs:
    row = {"accelerator": "H100-80GB", "skypilot": "H100", "gpus": 4, "gpus_per_node": 8, "strategy": "fsdp",
           "activation_checkpointing": True, "micro_batch_size": 1, "grad_accum_steps": 4, "precision": "bf16",
           "stack": "cuda", "fits": True}
    per_run = {"hours": 10.0, "cost": None, "cost_note": "no price for H100-80GB", "unknown": [], "spot": True,
               "price_per_gpu_hour": None,
               "items": [{"item": Item.RECOVERY, "hours": 0.5, "from": "x"}]}
    base = dict(name="job", spec_rel="job/pilot.yaml", workdir="/src", workdir_why="the spec's folder", row=row,
                per_run=per_run, runs=2, overrides=[("distributed.strategy", "single", "fsdp")], lock=lock(),
                lock_from="pilot p1", lock_file="/src/task.lock.json",
                requirements=requirements(lock(), Target.CUDA, "pilot p1"), bucket=Bucket("my-runs", "--bucket"),
                spot=True, checkpoint=Size(80 * GB, "measured"), export=Size(13 * GB, "estimated"),
                model_download=Size(None, "not measured: a Hub id"), data=Size(2 * GB, "local files"),
                source=PilotrunSource("/src/pilotrun", None, "the source tree"),
                campaign=CampaignPart("job/sweep.yaml", 3, 4, True, False))
    return TaskInputs(**(base | over))


def test_the_task_names_the_plans_accelerators_and_every_value_says_where_it_came_from():
    text = task_text(inputs())
    task = yaml.safe_load(text)
    res = task["resources"]
    assert (res["accelerators"], res["use_spot"], task["num_nodes"]) == ("H100:4", True, 1)
    # 60 base + 2 (pilot) + 3 (campaign) checkpoints of 80 GB + 1 export of 13 GB + 2 GB of data; the model: unknown
    assert res["disk_size"] == 60 + 5 * 80 + 13 + 2
    assert "not counted: model download: unknown (not measured: a Hub id)" in text
    assert "image_id" not in res and "# image_id: unknown: the lock records no container digest" in text
    mount = task["file_mounts"]["/pilotrun-bucket"]
    assert mount == {"name": "my-runs", "persistent": True, "mode": "MOUNT_CACHED"}
    assert task["file_mounts"]["/pilotrun/proven-lock.json"] == "/src/task.lock.json"
    assert task["envs"]["PILOTRUN_LEDGER"] == "/pilotrun-bucket/ledger.sqlite"
    lines = text.splitlines()
    head = lines[:lines.index("setup: |")]
    for i, line in enumerate(head):  # every value outside the scripts has its source on the line above
        if line.strip() and not line.lstrip().startswith("#") and line.strip() not in ("resources:", "file_mounts:",
                                                                                        "envs:"):
            assert head[i - 1].lstrip().startswith("#"), f"no source comment above {line!r}"
    for key in ("setup: |", "run: |"):
        assert lines[lines.index(key) - 1].startswith("# ")
    assert "the plan: 20.0 h for 2 run(s) on 4 GPU(s) (spot: 1.0 h of it the expected recovery); cost unknown" in text


def test_the_run_pilots_first_at_the_plans_configuration_then_continues_the_campaign_under_the_task_id():
    task = yaml.safe_load(task_text(inputs()))
    run = task["run"]
    pilot = run.index('-m pilotrun launch --nproc-per-node 4 "$WORKDIR/job/pilot.yaml" --set distributed.strategy=fsdp '
                      '--task-id "$TASK" --proven-lock "$PILOTRUN_PROVEN_LOCK"')
    campaign = run.index('-m pilotrun campaign "$WORKDIR/job/sweep.yaml" --task-id "$TASK" --engine ray --parallel 1')
    assert 0 < pilot < campaign and run.index("set -euo pipefail") < pilot
    setup = task["setup"]
    assert "uv venv --allow-existing --seed --python 3.11.7" in setup
    assert "\ntorch==2.13.0\n" in setup and "\ntransformers==5.1.0\n" in setup
    assert setup.index("pip install --quiet -r") < setup.index("--no-deps /pilotrun/src") < setup.index("-m pilotrun lock check")
    one = yaml.safe_load(task_text(inputs(row=inputs().row | {"gpus": 1, "strategy": "single"}, campaign=None,
                                          long_run="torchrun train.py --resume", overrides=[])))
    assert '-m pilotrun run "$WORKDIR/job/pilot.yaml" --task-id' in one["run"]
    assert one["run"].rstrip().endswith("torchrun train.py --resume") and "--set" not in one["run"]


def test_what_the_task_cannot_know_is_said_and_what_cannot_run_is_refused():
    digest = "sha256:" + "ab" * 32
    assert image_id({"container": {"digest": f"ghcr.io/org/img@{digest}", "from": "--container-digest"}})[0] == \
        f"docker:ghcr.io/org/img@{digest}"
    image, why = image_id({"container": {"digest": digest, "from": "$PILOTRUN_CONTAINER_DIGEST"}})
    assert image is None and "names no image" in why
    unnamed = inputs(row=inputs().row | {"skypilot": ""})
    assert "unknown SkyPilot name" in task_text(unnamed) and "H100-80GB:4" in task_text(unnamed)
    with pytest.raises(TaskRefused, match="over 2 nodes, and --campaign job/sweep.yaml runs your program"):
        task_text(inputs(row=inputs().row | {"gpus": 16}, campaign=CampaignPart("job/sweep.yaml", 3, 16, True, False,
                                                                                 over_nodes=False)))
    uri = yaml.safe_load(task_text(inputs(bucket=Bucket("s3://team/runs", "--bucket"))))
    assert uri["file_mounts"]["/pilotrun-bucket"] == {"source": "s3://team/runs", "mode": "MOUNT_CACHED"}
    assert bucket_problem("My_Bucket") and bucket_problem("s3://x/y") is None and bucket_problem("runs-1") is None


def test_every_built_in_accelerator_has_its_skypilot_name_and_a_bad_one_is_refused(tmp_path):
    assert {a.name: a.skypilot for a in load_catalog().values()}["H100-80GB"] == "H100"
    assert all(a.skypilot for a in load_catalog().values())
    bad = tmp_path / "c.yaml"
    bad.write_text("accelerators:\n  H100-80GB:\n    skypilot: 'H100 x4'\n")
    with pytest.raises(CatalogError, match="skypilot is SkyPilot's accelerator name"):
        load_catalog(bad)


# -- the command line's refusals: before anything is traced ----------------------------------------------------------

@pytest.mark.parametrize("extra, said", [
    (["--skypilot", "t.yaml"], "--skypilot writes one task: choose its accelerator with one --accelerator"),
    (["--accelerator", "H100-80GB", "--skypilot", "t.yaml", "--bucket", "My_Bucket"], "--bucket: 'My_Bucket' is neither"),
    (["--bucket", "my-runs"], "--bucket go(es) with --skypilot TASK.yaml"),
    (["--accelerator", "H100-80GB", "--skypilot", "t.yaml", "--campaign", "nope.yaml"], "--campaign: nope.yaml is not a"),
    (["--accelerator", "H100-80GB", "--skypilot", "t.yaml", "--long-run", "train.py\r$(touch x)"],
     "--long-run holds '\\r', a control character"),
])
def test_bad_task_flags_are_exit_2_naming_the_flag(tmp_path, extra, said):
    res = pilotrun_cli("plan", str(EXAMPLES / "llama-7b-estimate" / "pilot.yaml"), *extra, cwd=tmp_path)
    assert res.returncode == 2 and said in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "t.yaml").exists()


def test_lock_check_says_each_difference_and_exits_1(tmp_path):
    from pilotrun.lock import installed_distributions

    have = installed_distributions()
    name = "numpy"
    (tmp_path / "req.txt").write_text(f"{name}==0.0.1\n" + "".join(f"{k}=={v}\n" for k, v in list(have.items())[:3]
                                                                    if k != name))
    res = pilotrun_cli("lock", "check", "req.txt", cwd=tmp_path)
    assert res.returncode == 1 and f"{name}: pinned 0.0.1, installed {have[name]}" in res.stdout, res.stdout
    (tmp_path / "empty.txt").write_text("# nothing\n")
    res = pilotrun_cli("lock", "check", "empty.txt", cwd=tmp_path)
    assert res.returncode == 2 and "pins no distribution" in res.stderr
    res = pilotrun_cli("lock", "check", "missing.txt", cwd=tmp_path)
    assert res.returncode == 2 and "missing.txt is missing" in res.stderr


def test_lock_check_counts_only_pins_as_pins_and_names_every_file_it_could_not_read(tmp_path, monkeypatch):
    from pilotrun.lock import installed_distributions

    held = "".join(f"{k}=={v}\n" for k, v in list(installed_distributions().items())[:4] if k != "numpy")
    n = held.count("\n")
    (tmp_path / "req.txt").write_text("# python: 0.0.1\n" + held)
    res = pilotrun_cli("lock", "check", "req.txt", cwd=tmp_path)
    assert res.returncode == 1 and f"every one of the {n} pinned distribution(s) of req.txt is installed" in res.stdout
    assert "python differs: the file's header names 0.0.1, this environment runs" in res.stdout, res.stdout
    (tmp_path / "req.txt").write_text("# python: 0.0.1\nnumpy==0.0.1\n" + held)
    res = pilotrun_cli("lock", "check", "req.txt", cwd=tmp_path)
    assert res.returncode == 1 and f"1 of {n + 1} pinned distribution(s) differ" in res.stdout, res.stdout
    (tmp_path / "latin1.txt").write_bytes(b"numpy==2.4.6\n# caf\xe9\n")
    res = pilotrun_cli("lock", "check", "latin1.txt", cwd=tmp_path)
    assert res.returncode == 2 and "latin1.txt is not UTF-8 text (byte 18: invalid continuation byte)" in res.stderr, (
        res.stderr)
    info = tmp_path / "site" / "bad_dist-1.0.dist-info"  # an installed distribution whose METADATA is not UTF-8
    info.mkdir(parents=True)
    (info / "METADATA").write_bytes(b"Metadata-Version: 2.1\nName: bad\xff\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    (tmp_path / "req.txt").write_text(held)
    res = pilotrun_cli("lock", "check", "req.txt", cwd=tmp_path)
    assert res.returncode == 1 and "1 installed distribution(s) could not be read" in res.stdout, res.stdout
    assert f"{info / 'METADATA'}: not UTF-8 text (byte 31: invalid start byte)" in res.stdout


def test_lock_export_refuses_a_lock_whose_version_would_be_a_pip_option(tmp_path):
    (tmp_path / "evil.json").write_text(json.dumps(_with("distributions.numpy", "--index-url http://evil")))
    res = pilotrun_cli("lock", "export", str(EXAMPLES / "tiny-sft" / "pilot.yaml"), "--run", "evil.json", "-o",
                       "req.txt", cwd=tmp_path)
    assert res.returncode == 2 and "distributions.numpy is '--index-url http://evil', not a PEP 440" in res.stderr
    assert "(the lock of evil.json)" in res.stderr and not (tmp_path / "req.txt").exists()


def test_the_help_of_each_new_command_shows_an_example(tmp_path):
    for args, said in ((["plan", "--help"], "--skypilot task.yaml --bucket my-runs --campaign sweep.yaml"),
                       (["select", "--help"], "--skypilot task.yaml --bucket my-runs"),
                       (["lock", "export", "--help"], "pilotrun lock export examples/tiny-sft/pilot.yaml -o"),
                       (["lock", "check", "--help"], "pilotrun lock check requirements.lock.txt")):
        res = pilotrun_cli(*args, cwd=tmp_path)
        assert res.returncode == 0 and "examples:" in res.stdout and said in res.stdout, (args, res.stdout)
    res = pilotrun_cli("lock", cwd=tmp_path)
    assert res.returncode == 2 and "export" in res.stdout


def test_the_nodes_lock_gate_names_the_devices_build_apart_from_what_drifted(toy, tmp_path):
    from pilotrun.config import load_spec
    from pilotrun.lock import collect_lock
    from pilotrun.pilot import PilotOptions, run_pilot

    spec = load_spec(toy)
    proven = collect_lock(spec)
    here = proven["versions"]["torch"]
    base = here.split("+")[0]
    # The lock proven on another machine: the same torch built for another device, one distribution older.
    proven["versions"]["torch"] = proven["distributions"]["torch"] = base + ("+cu128" if here == base + "+cpu" else
                                                                             "+cpu")
    proven["distributions"]["nvidia-cublas-cu12"] = "12.8.4.1"
    proven["distributions"]["numpy"] = "0.0.1"
    result = run_pilot(spec, PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "l.sqlite", gates=["lock"],
                                          proven_lock=("the proven lock p.json", proven)))
    (row,) = result.rows
    assert row["verdict"] == "warn" and row["details"]["compared_with"] == "the proven lock p.json"
    assert "built for another device than the proven lock p.json in 3 field(s)" in row["reason"], row["reason"]
    assert "the environment drifted from the proven lock p.json in 1 field(s): distributions.numpy" in row["reason"]
    kinds = {d["field"]: d["kind"] for d in row["details"]["drift"]}
    assert kinds == {"versions.torch": "device", "distributions.torch": "device",
                     "distributions.nvidia-cublas-cu12": "device", "distributions.numpy": "environment"}
