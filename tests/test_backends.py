"""Device backends (pilotrun/backends): what differs between CUDA, ROCm, MPS and the CPU, tested on a CPU-only machine.

The pure parts are read off the objects; the runtime calls are faked one torch function at a time, and device
selection by patching the one device query (devices.query_devices), as the campaign tests do for slots.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from pilotrun import backends, devices
from pilotrun.backends import CPU, CUDA, MPS, Reading, ROCm
from pilotrun.devices import DeviceInventory, DeviceUnavailable

GIB = 2**30
PACKAGE = Path(__file__).resolve().parents[1] / "pilotrun"


def _fake(backend: str, n: int, name: str = "NVIDIA H100 80GB HBM3") -> DeviceInventory:
    return DeviceInventory(backend, n, (name,) * n, (80 * GIB,) * n)


def test_each_backend_says_its_process_group_visibility_variable_and_local_rank_device():
    table = {b.name: (b.dist_backend, b.visible_var, str(b.device(3)), b.indexed) for b in backends.BACKENDS}
    assert table == {"cuda": ("nccl", "CUDA_VISIBLE_DEVICES", "cuda:3", True),
                     "rocm": ("nccl", "HIP_VISIBLE_DEVICES", "cuda:3", True),
                     "mps": ("gloo", None, "mps", False),
                     "cpu": ("gloo", None, "cpu", False)}
    assert CUDA().ddp_device_ids(torch.device("cuda", 2)) == [2]
    assert CPU().ddp_device_ids(torch.device("cpu")) is None and MPS().ddp_device_ids(torch.device("mps")) is None
    assert CUDA().pin_memory and not CPU().pin_memory and not MPS().pin_memory
    assert backends.names() == ["cuda", "rocm", "mps", "cpu"]
    with pytest.raises(backends.UnknownBackend, match="no device backend 'tpu'; known: cuda, rocm, mps, cpu"):
        backends.get("tpu")


def test_the_torch_build_not_the_devices_says_whether_a_cuda_device_is_cuda_or_rocm(monkeypatch):
    from pilotrun.backends import cuda

    assert backends.for_device(torch.device("cuda", 0)).name == "cuda"  # this build has no HIP
    monkeypatch.setattr(cuda, "hip_version", lambda: "6.2.41133")
    assert backends.for_device(torch.device("cuda", 0)).name == "rocm"
    assert backends.for_device(torch.device("cpu")).name == "cpu"
    meta = backends.for_type("meta")
    assert isinstance(meta, backends.Unlisted) and meta.dist_backend == "gloo" and meta.visible_var is None


@pytest.mark.parametrize("rt, device", [(CPU(), torch.device("cpu")), (MPS(), torch.device("mps")),
                                        (backends.for_type("meta"), torch.device("meta"))])
def test_a_counter_that_does_not_exist_is_none_with_its_reason(rt, device):
    for reading in (rt.peak_allocated(device), rt.peak_reserved(device), rt.device_used(device),
                    rt.alloc_retries(device)):
        assert reading.value is None and reading.reason and device.type in reading.reason
    assert not rt.allocator_counts and rt.total_memory(device) is None and rt.rng_state() == {}
    if device.type != "mps":  # nothing to wait for (MPS waits on torch.mps, absent here)
        rt.synchronize(device)
    rt.reset_peaks(device)


def test_cuda_counters_are_the_allocator_s_and_rocm_reads_the_same_ones(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append(("alloc", d)) or 3 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 4 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (70 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d: {"num_alloc_retries": 2})
    dev = torch.device("cuda", 1)
    for rt in (CUDA(), ROCm()):
        assert rt.allocator_counts
        assert (rt.peak_allocated(dev), rt.peak_reserved(dev)) == (Reading(3 * GIB), Reading(4 * GIB))
        assert rt.device_used(dev) == Reading(10 * GIB) and rt.alloc_retries(dev) == Reading(2)
    assert calls == [("alloc", dev), ("alloc", dev)]


def test_the_accelerator_random_streams_keep_the_checkpoint_keys_of_every_checkpoint_so_far(monkeypatch):
    states = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
    put: list[tuple[int, list[int]]] = []
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda st, i: put.append((i, st.tolist())))
    for rt in (CUDA(), ROCm()):  # a checkpoint moves between the two: ROCm's torch is torch.cuda
        assert list(rt.rng_state()) == ["cuda_0", "cuda_1"]
    CUDA().set_rng_state({"torch_cpu": torch.get_rng_state(), "cuda_1": states[1], "cuda_0": states[0]})
    assert put == [(1, [3, 4]), (0, [1, 2])]  # the host's key is not the backend's


def test_a_checkpoint_s_rng_state_has_the_same_keys_through_the_backend(monkeypatch):
    from pilotrun.checkpoint import state

    states = [torch.tensor([7], dtype=torch.uint8), torch.tensor([8], dtype=torch.uint8)]
    put: list[int] = []
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda st, i: put.append(i))
    monkeypatch.setattr(state, "query_devices", lambda: _fake("cuda", 2))
    js, tensors = state.capture_rng()
    assert list(tensors) == ["torch_cpu", "cuda_0", "cuda_1"] and set(js) >= {"python", "numpy"}
    state.restore_rng(js, tensors)
    assert put == [0, 1]
    # The same checkpoint restored on a CPU-only machine: the GPU streams are left unused, as before.
    monkeypatch.setattr(state, "query_devices", lambda: DeviceInventory("cpu", 0))
    put.clear()
    state.restore_rng(js, tensors)
    assert put == []


def test_query_devices_asks_the_backends_in_order_and_names_the_first_available(monkeypatch):
    from pilotrun.backends import cuda

    class Props:
        name, total_memory = "AMD Instinct MI300X", 192 * GIB

    assert devices.query_devices() == DeviceInventory("cpu", 0)  # this machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    inv = devices.query_devices()
    assert (inv.backend, inv.count, inv.total_memory_bytes, type(inv.runtime)) == ("cuda", 2, (192 * GIB,) * 2, CUDA)
    monkeypatch.setattr(cuda, "hip_version", lambda: "6.2.41133")
    inv = devices.query_devices()
    assert inv.backend == "rocm" and inv.names == ("AMD Instinct MI300X",) * 2 and inv.versions["hip"] == "6.2.41133"


@pytest.mark.parametrize("inv, requested, device, reason", [
    (_fake("cuda", 2), "auto", "cuda:0", "auto: 2 cuda device(s) visible, using the first (NVIDIA H100 80GB HBM3)"),
    (_fake("rocm", 1, "AMD Instinct MI300X"), "auto", "cuda:0",
     "auto: 1 rocm device(s) visible, using the first (AMD Instinct MI300X)"),
    (_fake("cuda", 2), "cuda", "cuda:0", "requested cuda (NVIDIA H100 80GB HBM3)"),
    (_fake("rocm", 2), "cuda:1", "cuda:1", "requested cuda:1 (NVIDIA H100 80GB HBM3)"),
    (DeviceInventory("mps", 1, ("Apple MPS",)), "auto", "mps", "auto: Apple MPS visible"),
    (DeviceInventory("mps", 1, ("Apple MPS",)), "mps", "mps", "requested mps"),
    (_fake("cuda", 2), "cpu", "cpu", "requested cpu"),
    (DeviceInventory("cpu", 0), "auto", "cpu", "auto: no accelerator visible, running on CPU"),
])
def test_device_selection_on_fake_inventories(monkeypatch, inv, requested, device, reason):
    monkeypatch.setattr(devices, "query_devices", lambda: inv)
    assert devices.pick_device(requested) == (torch.device(device), reason)


@pytest.mark.parametrize("inv, requested, message", [
    (DeviceInventory("cpu", 0), "cuda", "train.device is 'cuda' but no CUDA/ROCm device is visible (use cpu or auto)"),
    (DeviceInventory("mps", 1, ("Apple MPS",)), "cuda:0", "no CUDA/ROCm device is visible"),
    (_fake("cuda", 2), "cuda:2", "train.device is 'cuda:2' but only 2 device(s) are visible"),
    (_fake("cuda", 2), "mps", "train.device is 'mps' but MPS is not available here (use cpu or auto)"),
])
def test_a_device_this_machine_lacks_is_refused_with_the_same_words(monkeypatch, inv, requested, message):
    monkeypatch.setattr(devices, "query_devices", lambda: inv)
    with pytest.raises(DeviceUnavailable, match=message.replace("(", r"\(").replace(")", r"\)")):
        devices.pick_device(requested)


def test_device_names_come_from_the_inventory_of_the_device_s_runtime(monkeypatch):
    monkeypatch.setattr(devices, "query_devices", lambda: DeviceInventory("rocm", 2, ("MI300X", "MI325X")))
    assert devices.device_name(torch.device("cuda", 1)) == "MI325X"
    assert devices.device_name(torch.device("cpu")) == "cpu"
    monkeypatch.setattr(devices, "query_devices", lambda: DeviceInventory("mps", 1, ("Apple MPS",)))
    assert devices.device_name(torch.device("mps")) == "Apple MPS"


@pytest.mark.parametrize("device_type, backend, set_to", [("cuda", "nccl", [1]), ("cpu", "gloo", [])])
def test_a_rank_joins_the_process_group_of_its_device_s_backend(monkeypatch, device_type, backend, set_to):
    from pilotrun import distributed

    joined: list[str] = []
    current: list[int] = []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", joined.append)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    env = distributed.init("ddp", device_type)
    assert (env.rank, env.local_rank, env.world_size) == (1, 1, 2)
    assert joined == [backend] and current == set_to


def test_the_meter_reads_the_backend_s_counters_and_says_why_one_is_missing(monkeypatch):
    from pilotrun.measure import meter

    class Counting(CPU):  # an allocator with peaks, and no device-wide counter
        allocator_counts = True
        resets = 0

        def reset_peaks(self, device):
            Counting.resets += 1

        def peak_allocated(self, device):
            return Reading(3 * GIB)

        def peak_reserved(self, device):
            return Reading(5 * GIB)

        def alloc_retries(self, device):
            return Reading(1)

        def device_used(self, device):
            return Reading(None, "this runtime has no mem_get_info")

        def total_memory(self, device):
            return 8 * GIB

    monkeypatch.setattr(meter.backends, "for_device", lambda device: Counting())
    with meter.StageMeter(torch.device("cpu")) as m:
        pass
    mem = m.memory
    assert (mem["peak_allocated_bytes"], mem["peak_reserved_bytes"], mem["alloc_retries"]) == (3 * GIB, 5 * GIB, 1)
    assert mem["device_used_bytes"] is None and mem["source"] == "cpu-allocator" and Counting.resets == 1
    assert mem["not_measured"] == {"device_used_bytes": "this runtime has no mem_get_info"}
    assert not m.uses_tensor_tracker
    reason = meter.out_of_memory_reason(torch.OutOfMemoryError("HIP out of memory"), torch.device("cpu"))
    assert reason.startswith("out of accelerator memory at 5.0 GiB reserved of 8.0 GiB: OutOfMemoryError")


def test_the_spec_devices_a_cluster_counts_as_gpus_and_the_lock_keys():
    assert [backends.numbered(d) for d in ("auto", "cuda", "cuda:3", "cpu", "mps")] == [True, True, True, False, False]
    assert list(backends.build_versions()) == ["cuda", "hip", "cudnn", "nccl"]  # the lock's keys, on every machine
    assert backends.OOM_WORDS == ("cuda", "hip", "mps", "xpu", "gpu")


def test_the_rocm_launcher_selection_composes_hip_then_cuda_and_a_worker_sees_hip_alone():
    environ = {"HIP_VISIBLE_DEVICES": "0,2,4,6", "CUDA_VISIBLE_DEVICES": "1,3", "PATH": "/bin"}
    assert ROCm().launcher_ids(2, environ) == (["2", "6"], "$HIP_VISIBLE_DEVICES=0,2,4,6 then "
                                                           "$CUDA_VISIBLE_DEVICES=1,3")
    assert CUDA().launcher_ids(2, environ) == (["1", "3"], "$CUDA_VISIBLE_DEVICES=1,3")
    assert CUDA().launcher_ids(3, environ) == (["0", "1", "2"], "all devices")  # too few listed: all of them
    assert ROCm().worker_env(environ, ["6"]) == {"HIP_VISIBLE_DEVICES": "6", "PATH": "/bin"}
    assert CUDA().worker_env(environ, ["3"])["CUDA_VISIBLE_DEVICES"] == "3"
    assert CPU().worker_env(environ, ["3"]) == environ


# What only a backend may ask torch: a runtime's module, its build's versions, its libraries.
RUNTIME_ATTRIBUTES = ("torch.cuda", "torch.mps", "torch.xpu", "torch.version.hip", "torch.version.cuda",
                      "torch.backends.cudnn", "torch.backends.mps")


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _runtime_questions(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            name = _dotted(node)
            if any(name == a or name.startswith(a + ".") for a in RUNTIME_ATTRIBUTES):
                found.append(f"line {node.lineno}: {name}")
        if (isinstance(node, ast.Call) and _dotted(node.func) == "getattr" and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)):  # getattr(torch.version, "hip", None)
            name = f"{_dotted(node.args[0])}.{node.args[1].value}"
            if name in RUNTIME_ATTRIBUTES:
                found.append(f"line {node.lineno}: {name}")
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "type":
            for right in node.comparators:
                if isinstance(right, ast.Constant) and right.value in ("cuda", "mps", "xpu"):
                    found.append(f"line {node.lineno}: .type compared with {right.value!r}")
    return sorted(found, key=lambda f: int(f.split()[1].rstrip(":")))


def _parsed(text: str) -> ast.AST:
    tree = ast.parse(text)
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]
    return tree


def test_the_check_below_finds_a_runtime_question():
    code = ('import torch\nif torch.cuda.is_available() and device.type == "cuda":\n    v = torch.version.hip\n'
            'w = getattr(torch.version, "hip", None)\n')
    assert set(_runtime_questions(_parsed(code))) == {"line 2: torch.cuda.is_available", "line 4: torch.version.hip",
                                                      "line 2: .type compared with 'cuda'", "line 3: torch.version.hip"}


def test_only_the_backends_ask_torch_about_a_device_runtime():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "backends" in path.relative_to(PACKAGE).parts:
            continue
        found += [f"{path.relative_to(PACKAGE.parent)} {q}" for q in _runtime_questions(_parsed(path.read_text()))]
    assert not found, "ask pilotrun.backends instead: " + "; ".join(found)
