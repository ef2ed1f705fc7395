"""One campaign run per accelerator: the device assignment, the cap on runs at once, and the worker's variable.

The assignment is pure (an inventory in, slots out), tested on this CPU-only machine with inventories
of several GPUs; the hook where workers start is tested by a real two-run campaign whose device query
is patched to report two GPUs (the workers still train on the CPU: the variable is all they get).
"""
from __future__ import annotations

import subprocess

import pytest
import yaml

from pilotrun.campaign.devices import DeviceMode, assign_devices, worker_device_env
from pilotrun.campaign.resources import Limit, PerRun, plan_parallel
from pilotrun.devices import DeviceInventory
from tests.conftest import TEST_DIGEST, copy_example

GIB = 2**30


def _gpus(n: int, backend: str = "cuda", memory: int = 80 * GIB, name: str = "NVIDIA H100 80GB HBM3"):
    return DeviceInventory(backend, n, (name,) * n, (memory,) * n)


def test_each_run_gets_its_own_device_and_a_world_size_of_k_gets_k():
    s = assign_devices(_gpus(8), "auto")
    assert s.mode == DeviceMode.PER_RUN and s.env_var == "CUDA_VISIBLE_DEVICES"
    assert s.slots == tuple((str(i),) for i in range(8))
    assert s.env(s.slots[3]) == {"CUDA_VISIBLE_DEVICES": "3"}
    s = assign_devices(_gpus(8), "cuda", per_run=2)
    assert s.slots == (("0", "1"), ("2", "3"), ("4", "5"), ("6", "7"))
    assert s.env(s.slots[1]) == {"CUDA_VISIBLE_DEVICES": "2,3"} and "2 devices (its world size)" in s.reason
    s = assign_devices(_gpus(5), "auto", per_run=2)  # the fifth device is left idle, not half a run
    assert s.slots == (("0", "1"), ("2", "3"))
    s = assign_devices(_gpus(1), "auto", per_run=2)
    assert s.slots == () and "not enough for one run, which needs 2" in s.reason


def test_a_launcher_that_already_narrowed_the_devices_is_respected():
    # Under CUDA_VISIBLE_DEVICES=2,5 this process's cuda:1 is the machine's device 5: the worker gets "5".
    s = assign_devices(_gpus(2), "auto", environ={"CUDA_VISIBLE_DEVICES": "2,5"})
    assert s.slots == (("2",), ("5",)) and "$CUDA_VISIBLE_DEVICES=2,5" in s.reason
    uuids = "GPU-aaaa,GPU-bbbb"
    assert assign_devices(_gpus(2), "auto", environ={"CUDA_VISIBLE_DEVICES": uuids}).slots == (("GPU-aaaa",),
                                                                                                ("GPU-bbbb",))


def test_rocm_workers_get_hip_visible_devices_and_no_inherited_cuda_selection():
    s = assign_devices(_gpus(4, "rocm", 192 * GIB, "AMD Instinct MI300X"), "auto",
                       environ={"HIP_VISIBLE_DEVICES": "0,1,2,3,4,5", "CUDA_VISIBLE_DEVICES": "1,3,4,5"})
    assert s.env_var == "HIP_VISIBLE_DEVICES" and s.slots == (("1",), ("3",), ("4",), ("5",))
    env = worker_device_env(s.to_dict(), {"CUDA_VISIBLE_DEVICES": "1,3,4,5", "PATH": "/bin"}, s.slots[2])
    assert env == {"HIP_VISIBLE_DEVICES": "4", "PATH": "/bin"}


@pytest.mark.parametrize("backend, device, mode", [
    ("cpu", "auto", DeviceMode.CPU), ("cuda", "cpu", DeviceMode.CPU), ("mps", "auto", DeviceMode.CPU),
    ("cuda", "cuda:1", DeviceMode.SHARED),
])
def test_cpu_machines_and_pinned_devices_change_nothing(backend, device, mode):
    inv = _gpus(4, backend) if backend != "cpu" else DeviceInventory("cpu", 0)
    s = assign_devices(inv, device, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert s.mode == mode and s.slots == () and s.env_var is None
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert worker_device_env(s.to_dict(), env, ["0"]) == env  # the launcher's environment, untouched
    plan = plan_parallel(3, cpus=2, host_available_bytes=64 * GIB, accelerator=None, per_run=None, devices=s)
    assert plan["parallel"] == 2 and plan["limited_by"] == Limit.CPU_CORES  # CPU: cores cap it, as before


def test_the_devices_cap_the_runs_and_the_plan_says_which_limit_applied():
    s = assign_devices(_gpus(4), "auto")
    measured = PerRun(host_bytes=2 * GIB, device_bytes=30 * GIB, source="pilot-1")
    p = plan_parallel(9, cpus=16, host_available_bytes=200 * GIB, accelerator=None, per_run=measured, devices=s)
    assert (p["parallel"], p["limited_by"]) == (4, str(Limit.DEVICES))
    assert p["reasons"] == ["4 cuda device(s) visible (all devices): each run gets one device through "
                            "$CUDA_VISIBLE_DEVICES"]
    assert p["devices"]["slots"] == [["0"], ["1"], ["2"], ["3"]] and p["threads_per_run"] == 4
    assert any("80.0 GiB per device, one run reserved 30.0 GiB in pilot pilot-1" in c for c in p["checked"])
    # Fewer asked than devices: the request is the limit, and only that many slots are handed out.
    p = plan_parallel(2, cpus=16, host_available_bytes=200 * GIB, accelerator=None, per_run=measured, devices=s)
    assert (p["parallel"], p["limited_by"], p["devices"]["slots"]) == (2, "requested", [["0"], ["1"]])
    # Host memory binds before the devices do.
    p = plan_parallel(4, cpus=16, host_available_bytes=5 * GIB, accelerator=None, per_run=measured, devices=s)
    assert (p["parallel"], p["limited_by"]) == (2, str(Limit.HOST_MEMORY))


def test_a_run_that_does_not_fit_one_device_is_said_and_runs_alone():
    s = assign_devices(_gpus(4, memory=24 * GIB, name="NVIDIA L4"), "auto")
    p = plan_parallel(4, cpus=16, host_available_bytes=200 * GIB, accelerator=None,
                      per_run=PerRun(host_bytes=None, device_bytes=30 * GIB, source="pilot-h100"), devices=s)
    assert (p["parallel"], p["limited_by"]) == (1, str(Limit.DEVICE_MEMORY))
    assert p["reasons"][-1] == "even one run may not fit; running one at a time"
    assert "NVIDIA L4: 24.0 GiB per device, one run reserved 30.0 GiB" in p["reasons"][0]
    p = plan_parallel(4, cpus=16, host_available_bytes=200 * GIB, accelerator=None,
                      per_run=PerRun(host_bytes=GIB, device_bytes=None, source="cpu-pilot"), devices=s)
    assert p["parallel"] == 4 and "NVIDIA L4 memory not checked: pilot cpu-pilot has no device" in p["not_checked"][0]


@pytest.mark.parametrize(("command", "processes"), [
    ("python train.py", None), ("torchrun --standalone --nproc-per-node 2 train.py", 2),
    ("torchrun --nproc_per_node=4 train.py --nproc-per-node 9", 4),  # the script's own flag is not the launcher's
    (".venv/bin/torchrun -m --nproc-per-node 2 train", 2),  # torchrun's -m runs the script as a module
    ("torchrun --no-python ./run.sh --nproc-per-node 9", 1),  # the launcher's default: one
    ("python3.11 -u -X importtime -m torch.distributed.run --nproc-per-node=3 -m train", 3),
    ("python -m torch.distributed.launch --nproc_per_node 2 train.py", 2),
    ("accelerate launch --num_processes 2 t.py", 2), ("accelerate launch --num_processes 8 --num_machines 2 t.py", 4),
    ("accelerate launch t.py --num_processes 2", None),  # accelerate's config file decides: not read here
    ("torchrun --nproc-per-node gpu train.py", None), ("deepspeed --num_gpus 8 train.py", None)])
def test_a_programs_launcher_says_how_many_processes_a_run_starts(command, processes):
    import shlex

    from pilotrun.config.program import launcher_processes

    assert launcher_processes(shlex.split(command)) == processes


def test_a_program_campaign_gives_each_run_as_many_devices_as_its_launcher_starts(tmp_path, monkeypatch):
    """Each run of `torchrun --nproc-per-node 2 train.py` gets two of the four GPUs, so two run at once; a plain
    `python train.py` gets one each."""
    from pilotrun.campaign import orchestrate
    from pilotrun.campaign.spec import load_campaign
    from pilotrun.config import load_spec

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(orchestrate, "query_devices", lambda: _gpus(4))
    (tmp_path / "train.py").write_text("print('hi')\n")
    for command, slots in (("torchrun --standalone --nproc-per-node 2 train.py", [["0", "1"], ["2", "3"]]),
                           ("python train.py", [["0"], ["1"], ["2"], ["3"]])):
        (tmp_path / "pilot.yaml").write_text(yaml.safe_dump({"name": "prog", "program": {"command": command}}))
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({
            "name": "c", "base": "pilot.yaml", "vary": {"lr": [0.1, 0.2]}, "seeds": [1, 2], "updates": 4,
            "program": {"args": ["--lr", "{value}", "--seed", "{seed}"]}}))
        c = load_campaign(tmp_path / "c.yaml")
        plan = orchestrate.parallel_plan(c, load_spec(tmp_path / "pilot.yaml", allow_program=True), 4,
                                         tmp_path / "l.sqlite")
        assert plan["devices"]["slots"] == slots and plan["parallel"] == len(slots), plan
        assert plan["devices"]["per_run"] == len(slots[0])
    # Two processes per run and one GPU: no run can have its devices, refused before the start (it would otherwise
    # start on every device, or share one).
    monkeypatch.setattr(orchestrate, "query_devices", lambda: _gpus(1))
    (tmp_path / "pilot.yaml").write_text(yaml.safe_dump({"name": "prog", "program": {
        "command": "torchrun --standalone --nproc-per-node 2 train.py"}}))
    with pytest.raises(orchestrate.CampaignError, match="each run starts 2 processes, one device each: 1 cuda device"):
        orchestrate.parallel_plan(c, load_spec(tmp_path / "pilot.yaml", allow_program=True), 4, tmp_path / "l.sqlite")


def test_a_cluster_is_asked_for_a_cpu_and_a_gpu_per_process_of_a_programs_run(tmp_path):
    from pilotrun.campaign import orchestrate
    from pilotrun.config import load_spec

    asked = []

    class Cluster:  # the engine's plan as Ray's is called (engines/ray.py), recording what each run asks for
        def plan(self, requested, runs, spec, per_run, processes):
            asked.append(processes)
            return {"parallel": 1}

    (tmp_path / "train.py").write_text("print('hi')\n")
    for command in ("accelerate launch --num_processes 4 train.py", "python train.py"):
        (tmp_path / "pilot.yaml").write_text(yaml.safe_dump({"name": "prog", "program": {"command": command}}))
        spec = load_spec(tmp_path / "pilot.yaml", allow_program=True)
        orchestrate.cluster_plan(Cluster(), 2, 4, spec, None, 1)
    assert asked == [4, 1]


def test_a_run_of_several_processes_takes_a_core_a_thread_share_and_host_memory_per_process():
    measured = PerRun(host_bytes=2 * GIB, device_bytes=None, source="pilot-1")
    p = plan_parallel(8, cpus=8, host_available_bytes=200 * GIB, accelerator=None, per_run=measured, processes=2)
    assert (p["parallel"], p["limited_by"], p["threads_per_run"]) == (4, str(Limit.CPU_CORES), 1)
    assert p["reasons"] == ["8 CPU core(s), 2 processes per run: more CPU processes than cores only makes each slower"]
    p = plan_parallel(2, cpus=8, host_available_bytes=200 * GIB, accelerator=None, per_run=measured, processes=2)
    assert p["threads_per_run"] == 2 and p["text"].endswith("2 CPU thread(s) each of its processes")
    p = plan_parallel(4, cpus=64, host_available_bytes=10 * GIB, accelerator=None, per_run=measured, processes=2)
    assert (p["parallel"], p["limited_by"]) == (2, str(Limit.HOST_MEMORY))  # 2 x 2 GiB per run in 9 GiB
    assert "one process peaked at 2.0 GiB x 2 per run in pilot pilot-1" in p["reasons"][0]


@pytest.mark.process
def test_each_campaign_worker_is_started_with_its_own_device(tmp_path, monkeypatch):
    """A real two-run campaign, --parallel 3 on a node reporting two GPUs: two at once, each on its own device."""
    from pilotrun.campaign import orchestrate

    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(orchestrate, "query_devices", lambda: _gpus(2))
    seen: dict[str, str | None] = {}
    real_popen = subprocess.Popen

    def spy(cmd, *args, **kw):  # the real worker runs; its environment is noted on the way
        if "pilotrun.campaign.worker" in cmd:
            seen[cmd[cmd.index("--run-id") + 1]] = kw["env"].get("CUDA_VISIBLE_DEVICES")
        return real_popen(cmd, *args, **kw)

    monkeypatch.setattr(subprocess, "Popen", spy)  # procs.Tree starts the keeper with it
    copy_example("tiny-sft", tmp_path)
    body = {"name": "gpus", "base": "tiny-sft/pilot.yaml", "vary": {"train.optimizer.lr": [3e-3, 1e-3]},
            "seeds": [1], "updates": 2, "eval": {"every": 2},
            "keep": {"checkpoint": False, "export": False, "control_set": 0}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(body))
    res = orchestrate.run_campaign(tmp_path / "c.yaml", tmp_path / "l.sqlite", tmp_path / "runs", parallel=3)
    assert res["parallel"]["parallel"] == 2 and res["parallel"]["limited_by"] == "devices"
    assert [r["status"] for r in res["runs"]] == ["finished", "finished"]
    assert sorted(v for v in seen.values() if v is not None) == ["0", "1"]  # two at once: one device each
    for r in res["runs"]:  # the row says where its worker ran
        assert r["meta"]["devices"] == {"CUDA_VISIBLE_DEVICES": seen[r["run_id"]]}
