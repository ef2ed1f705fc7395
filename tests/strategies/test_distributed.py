"""Scale out on torchrun: real two-process gloo runs of the demo under DDP and FSDP2."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pilotrun.batching import batch_plan
from pilotrun.ledger.records import GateRow
from pilotrun.pilot import rank_summary
from pilotrun.train.sampler import DataPlan
from tests.conftest import SPEC_ORDER, copy_example, copy_fixture, gate_rows, pilotrun_cli, steady_verdicts


def test_each_rank_takes_its_slice_of_the_shared_order():
    one = DataPlan(n_examples=22, micro_batch_size=4, grad_accum_steps=2, seed=3)
    ranks = [DataPlan(22, 2, 2, 3, replicas=2, rank=r) for r in (0, 1)]
    assert ranks[0].micro_batches_per_epoch == one.micro_batches_per_epoch == 6
    for i in range(one.micro_batches_per_epoch):
        assert ranks[0].micro_batch(0, i) + ranks[1].micro_batch(0, i) == one.micro_batch(0, i)
    assert ranks[0].global_window_examples(4) == 6  # the last window: 4 + 2 examples over both ranks
    # A last step that cannot give every rank an example is dropped on all of them.
    assert DataPlan(21, 2, 2, 3, replicas=2).micro_batches_per_epoch == 5
    assert DataPlan(9, 4, 1, 0, replicas=2).micro_batches_per_epoch == 1
    assert batch_plan(2, 8, 4, 3200, model_parallel=2)["examples_per_update"] == 64


def test_rank_summary_flags_real_imbalance_only():
    rows = [{"gate": "steady_step", "verdict": "pass", "rank": 0, "seconds": 1.0,
             "memory": {"peak_allocated_bytes": 100 * 2**20}},
            {"gate": "steady_step", "verdict": "warn", "rank": 1, "seconds": 1.6,
             "memory": {"peak_allocated_bytes": 150 * 2**20}}]
    (s,) = rank_summary([GateRow.from_mapping(r) for r in rows])
    assert s.verdict == "warn" and s.worst_rank == 1 and s.max_peak_allocated_bytes == 150 * 2**20
    assert any("memory differs" in f for f in s.imbalance) and any("time differs" in f for f in s.imbalance)
    assert s.to_json()["imbalance"] == list(s.imbalance)  # report.json's ranks_summary entry
    rows[1]["memory"]["peak_allocated_bytes"] = 100 * 2**20 + 4096
    rows[1]["seconds"] = 1.05
    assert rank_summary([GateRow.from_mapping(r) for r in rows])[0].imbalance == ()


@pytest.mark.process
def test_launch_refuses_what_cannot_run(tmp_path, monkeypatch):
    from pilotrun import devices
    from pilotrun.cli.common import UsageError
    from pilotrun.cli.launch import plan_processes

    with pytest.raises(UsageError, match="no accelerator is visible: give --nproc-per-node"):
        plan_processes(None, 1)
    monkeypatch.setattr(devices, "query_devices", lambda: devices.DeviceInventory("cuda", 2, ("A", "B"), (1, 1)))
    import pilotrun.cli.launch as launch

    monkeypatch.setattr(launch, "query_devices", devices.query_devices)
    assert plan_processes(None, 1)[0] == 2
    with pytest.raises(UsageError, match="--nproc-per-node 4 but only 2 cuda device"):
        plan_processes(4, 1)
    spec = copy_example("tiny-sft", tmp_path)
    res = pilotrun_cli("launch", "--nproc-per-node", "2", str(spec), cwd=tmp_path)
    assert res.returncode == 2 and "need distributed.strategy ddp or fsdp" in res.stderr
    (tmp_path / "bad.sqlite").write_text("not a ledger")  # one clear error before any rank starts
    res = pilotrun_cli("launch", "--nproc-per-node", "2", str(spec), "--set", "distributed.strategy=ddp",
                       "--ledger", str(tmp_path / "bad.sqlite"), cwd=tmp_path)
    assert res.returncode == 2 and "bad.sqlite is not a usable SQLite ledger" in res.stderr, res.stderr
    assert "rank" not in res.stdout + res.stderr


SHUTDOWN_LOOP = """
import sys, torch
import torch.distributed as dist
from pilotrun import distributed, strategies

rank, store = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
for i in range(20):
    dist.init_process_group("gloo", init_method=f"file://{store}.{i}", rank=rank, world_size=2)
    env = distributed.DistEnv(rank, rank, 2, "ddp")
    model = strategies.get("ddp").wrap(torch.nn.Linear(4, 4), env, torch.device("cpu"))[0]
    model(torch.ones(2, 4)).sum().backward()
    distributed.gather(env, {"rank": rank, "rows": list(range(50))})
    distributed.shutdown(env)  # the model is still referenced here, as it once was in the pilot
    del model                  # before: its Reducer destroyed the group here, holding the GIL
    print("shut down", i, flush=True)
print("done", flush=True)
"""
STALLED_S = 120  # no line from a rank for this long: it is stuck (a quiet iteration takes well under a second)


def _outputs_unless_stalled(procs: list[subprocess.Popen], stalled_s: float) -> list[tuple[str, str]] | None:
    """Every process's (stdout, stderr) once all have exited; None (and every process killed) when none printed a
    line for ``stalled_s`` seconds while one still ran. Waits on progress, not on a total time: a loaded machine
    is slow, a deadlocked rank silent."""
    import threading
    import time

    texts: list[list[str]] = [[] for _ in range(2 * len(procs))]
    last = [time.monotonic()]

    def read(stream, into):
        for line in stream:
            into.append(line)
            last[0] = time.monotonic()

    streams = [s for p in procs for s in (p.stdout, p.stderr)]
    readers = [threading.Thread(target=read, args=(stream, texts[i]), daemon=True) for i, stream in enumerate(streams)]
    for t in readers:
        t.start()
    stalled = False
    while not stalled and any(p.poll() is None for p in procs):
        stalled = time.monotonic() - last[0] > stalled_s
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for t in readers:
        t.join()
    for stream in streams:
        stream.close()
    return None if stalled else [("".join(texts[2 * i]), "".join(texts[2 * i + 1])) for i in range(len(procs))]


@pytest.mark.process
def test_shutdown_after_ddp_does_not_deadlock(tmp_path):
    # A DDP Reducer holding the process group's last reference destroys it with the GIL held while a
    # gloo thread waits for the GIL to free a finished collective's tensors: a rank that never exits
    # (it hung a CI run). shutdown() frees every Reducer while the group is still registered.
    procs = [subprocess.Popen([sys.executable, "-c", SHUTDOWN_LOOP, str(rank), str(tmp_path / "store")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = _outputs_unless_stalled(procs, STALLED_S)
    if outs is None:
        pytest.fail(f"a rank deadlocked in the process group's destruction (no progress for {STALLED_S} s)")
    assert [p.returncode for p in procs] == [0, 0] and all("done" in o for o, _ in outs), outs
    assert all(o.count("shut down") == 20 for o, _ in outs), outs
    # Finding the DDP modules must not read torch.distributed.reduce_op's attributes (a FutureWarning per rank).
    assert not any("reduce_op" in err for _, err in outs), outs


# A group destroyed while torch.distributed.nn.functional's default arguments still hold it (the module imported
# after init_process_group: torch._dynamo imports it, and a torch.optim optimizer imports torch._dynamo) keeps its gloo
# threads into interpreter shutdown, where freeing the last collective's tensor aborted finished ranks (exit -6,
# "terminate called without an active exception": the CI run that failed a program campaign). A group a program
# never destroys (a Trainer's) aborts the same way (a CI run's resumed HF Trainer rank): the handle's exit hook
# closes a gloo group as pilotrun's own shutdown does.
GROUP_LEFT = """
import os, sys, torch
import torch.distributed as dist
from pilotrun import distributed

def gloo_threads():
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in os.listdir("/proc/self/task"))

order, store = sys.argv[1], sys.argv[2]
if order == "pilotrun":
    distributed.import_before_group()  # what distributed.init does
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
if order in ("handle", "left"):  # a program under pilotrun: its handle's exit hook closes or releases the group
    from pilotrun.program import ProgramHandle
    job = ProgramHandle({"PILOTRUN_PROGRAM": "1", "PILOTRUN_ROLE": "stages", "PILOTRUN_EVENTS": store + ".events"})
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)  # imports torch._dynamo, which imports the module
value = torch.ones(3)
dist.all_reduce(value)
if order in ("handle", "left"):  # a Trainer's program: a DDP model alive; "left": the group never destroyed
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.ones(1, 2)).sum().backward()
if order != "left":
    dist.destroy_process_group()
held = gloo_threads()
if order in ("handle", "left"):
    job._at_exit()  # what atexit runs before the interpreter shuts down
    released = int(held > 0 and gloo_threads() == 0 and not dist.is_initialized())
else:
    released = distributed.release_destroyed_groups()
print(held, released, gloo_threads(), flush=True)
"""


@pytest.mark.process
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts the gloo threads in /proc/self/task")
@pytest.mark.parametrize("order", ["pilotrun", "program", "handle", "left"])
def test_a_gloo_group_is_freed_before_interpreter_shutdown(tmp_path, order):
    res = subprocess.run([sys.executable, "-c", GROUP_LEFT, order, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    held, released, left = map(int, res.stdout.split())
    assert left == 0, "the group's gloo threads outlived destroy_process_group and the release"
    if order == "pilotrun":  # imported first, the module's defaults never held the group
        assert (held, released) == (0, 0)
    elif (held, released) == (0, 0):
        pytest.skip(f"torch {torch.__version__} frees a destroyed group that the module imported late")
    else:  # a program that imported it late: torch held the group and its threads until the release
        assert held > 0 and released > 0, (held, released)


def _losses(ledger, run_id=None) -> list[tuple[int, float]]:
    with sqlite3.connect(ledger) as con:
        q = "SELECT rank, loss FROM metrics WHERE gate IN ('first_step', 'steady_step')"
        q += " AND run_id = ?" if run_id else ""
        return [(r, round(x, 9)) for r, x in con.execute(q + " ORDER BY rank, step", (run_id,) if run_id else ())]


@pytest.mark.process
def test_fsdp_pilot_on_two_processes_passes_every_gate(tmp_path):
    spec = copy_example("tiny-sft", tmp_path)
    ledger, out = tmp_path / "l.sqlite", tmp_path / "fsdp"
    res = pilotrun_cli("launch", "--nproc-per-node", "2", str(spec), "--set", "distributed.strategy=fsdp",
                       "--out", str(out), "--ledger", str(ledger), cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2
    by_rank = {(g["gate"], g["rank"]) for g in report["gates"]}
    assert by_rank == {(g, r) for g in SPEC_ORDER for r in (0, 1)}  # every gate, every rank
    assert all(g["verdict"] == "pass" for g in report["gates"] if g["gate"] != "lock"), \
        [(g["gate"], g["rank"], g["reason"]) for g in report["gates"] if g["verdict"] != "pass"]
    assert [s["gate"] for s in report["ranks_summary"]] == SPEC_ORDER
    load = next(g for g in report["gates"] if g["gate"] == "load" and g["rank"] == 0)
    assert "FSDP2 over 2 processes (gloo)" in load["details"]["strategy"]
    assert load["details"]["examples_per_update"] == 32
    save = next(g for g in report["gates"] if g["gate"] == "save" and g["rank"] == 0)
    assert save["details"]["layout"].startswith("torch.distributed.checkpoint")
    assert "2 fresh processes (torchrun)" in next(g["reason"] for g in report["gates"] if g["gate"] == "restore")
    # The distributed checkpoint, read by a plain script without the original processes.
    ckpt = save["details"]["path"]
    # Read only because the ledger recorded its manifest (DCP metadata is a pickle).
    for name in ("c.pt", "c.safetensors"):
        res = pilotrun_cli("convert", ckpt, "--out", str(tmp_path / name), "--ledger", str(ledger), cwd=tmp_path)
        assert res.returncode == 0, res.stderr
    script = ("import sys, torch\nfrom safetensors.torch import load_file\n"
              "s = torch.load(sys.argv[1], weights_only=True)\nw = load_file(sys.argv[2])\n"
              "assert set(s) == {'model', 'optimizer'} and len(s['model']) == len(w) > 0\n"
              "assert all(torch.equal(s['model'][k], w[k]) for k in w)\nprint('ok', len(w))\n")
    check = subprocess.run([sys.executable, "-c", script, str(tmp_path / "c.pt"), str(tmp_path / "c.safetensors")],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and check.stdout.startswith("ok"), check.stderr
    # Same losses as one process with the same examples per update (2 x 8 per micro step = one micro batch of 16).
    single = tmp_path / "single"
    (single).mkdir()
    one = gate_rows(spec, single, "train.micro_batch_size=16", gates=["steady_step", "export"])
    reference = [x for _, x in _losses(single / "l.sqlite")]
    fsdp = [x for r, x in _losses(ledger) if r == 0]
    assert fsdp == pytest.approx(reference, rel=1e-5)
    # The export gathered from shards is the single-process export: tie_word_embeddings keeps lm_head.weight
    # out of the file (20 tensors), every tensor under the same name, dtype, shape and offsets, the same bytes.
    export = next(g for g in report["gates"] if g["gate"] == "export" and g["rank"] == 0)
    assert export["details"]["tensors"] == one["export"]["details"]["tensors"] == 20
    mine, theirs = (Path(p) / "model.safetensors" for p in (export["details"]["path"], one["export"]["details"]["path"]))
    assert _safetensors_header(mine) == _safetensors_header(theirs)
    assert "lm_head.weight" not in _safetensors_header(mine)
    assert mine.stat().st_size == theirs.stat().st_size
    assert export["details"]["bytes"] == one["export"]["details"]["bytes"]


def _safetensors_header(path: Path) -> dict:
    """The file's header: every tensor's name, dtype, shape and byte offsets, and the metadata."""
    raw = path.read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


@pytest.mark.process
def test_fsdp_pilot_in_bf16_gathers_in_bf16_and_passes_every_gate(tmp_path):
    """bf16 over fp32 master weights as FSDP2 jobs run it (MixedPrecisionPolicy: gathered in bf16, reduced in
    fp32), which is what the estimate counts: the restore in fresh processes still resumes exactly, and the reload
    runs the export's parameters in bf16 as the model computed."""
    spec = copy_example("tiny-sft", tmp_path)
    out = tmp_path / "fsdp"
    res = pilotrun_cli("launch", "--nproc-per-node", "2", str(spec), "--set", "distributed.strategy=fsdp",
                       "--set", "train.precision=bf16", "--out", str(out), "--ledger", str(tmp_path / "l.sqlite"),
                       cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert {(g["gate"], g["rank"]) for g in report["gates"]} == {(g, r) for g in SPEC_ORDER for r in (0, 1)}
    assert all(g["verdict"] == "pass" for g in report["gates"] if g["gate"] != "lock"), \
        [(g["gate"], g["rank"], g["reason"]) for g in report["gates"] if g["verdict"] != "pass"]
    for rank in (0, 1):
        load = next(g for g in report["gates"] if g["gate"] == "load" and g["rank"] == rank)
        assert "parameters gathered in bf16, gradients reduced in fp32" in load["details"]["strategy"]
    # On the CPU the reload, its parameters cast to bf16 as FSDP2 gathers them, computes the same outputs: the usual
    # tolerance holds (the outputs' scale is for a GPU's kernels), and the export holds the fp32 masters.
    reload = next(g for g in report["gates"] if g["gate"] == "reload_eval" and g["rank"] == 0)
    assert "gathered in bf16" in reload["details"]["reference"]
    assert reload["details"]["tolerance"] == {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.process
def test_ddp_pilot_matches_one_process(tmp_path):
    spec = copy_fixture("toylm", tmp_path)  # micro batch 4 per rank, 3 micro steps per update
    ledger, out = tmp_path / "l.sqlite", tmp_path / "ddp"
    scratch = Path(os.environ["TMPDIR"])  # this test's own, for every process it starts (tests/conftest.py)
    res = pilotrun_cli("launch", "--nproc-per-node", "2", str(spec), "--set", "distributed.strategy=ddp",
                       "--gates", "steady_step,save,restore", "--out", str(out), "--ledger", str(ledger),
                       cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    # A tiny model's updates, descheduled on a loaded 2-core machine, can wait on data past the warning's share:
    # that steady_step warn names the machine, not the job (steady_verdicts), and is read as a pass per rank.
    for rank in (0, 1):
        rows = {g["gate"]: g for g in report["gates"] if g["rank"] == rank}
        assert set(steady_verdicts(rows).values()) == {"pass"}, rows
    assert {g["rank"] for g in report["gates"]} == {0, 1}
    ddp = _losses(ledger)
    assert [x for r, x in ddp if r == 0] == [x for r, x in ddp if r == 1]  # both ranks see the global loss
    single = tmp_path / "single"
    single.mkdir()
    gate_rows(spec, single, "train.micro_batch_size=8", gates=["steady_step"])
    reference = [x for _, x in _losses(single / "l.sqlite")]
    assert len(reference) == 3  # pilot.updates: the first update and two steady ones, compared one by one
    assert [x for r, x in ddp if r == 0] == pytest.approx(reference, rel=1e-5)
    # torchrun's own folders (the launch's, and the restore gate's two-rank worker's) are in the run's folder, not
    # one /tmp/torchelastic_* per torchrun that nothing removes.
    assert not list(scratch.glob("torchelastic_*")), sorted(p.name for p in scratch.iterdir())
    # One folder per rendezvous: the launch's, and the restore gate's two-rank worker's (the ranks pass theirs on).
    assert len(list((out / "torchrun").iterdir())) == 2, sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def _restore_rows(report: dict) -> dict[int, dict]:
    return {g["rank"]: g for g in report["gates"] if g["gate"] == "restore"}


@pytest.mark.process
def test_ddp_restores_batchnorm_statistics_as_rank_0s_and_still_catches_an_unsaved_buffer(tmp_path):
    from pilotrun.checkpoint.state import _digest

    spec = copy_fixture("bncnn", tmp_path)
    out = tmp_path / "ddp"
    args = ["launch", "--nproc-per-node", "2", str(spec), "--set", "distributed.strategy=ddp",
            "--gates", "steady_step,save,restore", "--ledger", str(tmp_path / "l.sqlite")]
    res = pilotrun_cli(*args, "--out", str(out), cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    restore = _restore_rows(report)
    assert {r: g["verdict"] for r, g in restore.items()} == {0: "pass", 1: "pass"}
    assert "rank 0's saved copy" in restore[0]["reason"] and "broadcast_buffers=True" in restore[0]["reason"]
    # The case has teeth: after their last forward the ranks' running statistics really differed.
    ckpt = Path(next(g for g in report["gates"] if g["gate"] == "save" and g["rank"] == 0)["details"]["path"])
    saved = [json.loads((ckpt.parent / f"{ckpt.name}.expect.rank{r}.json").read_text())["buffers"] for r in (0, 1)]
    name = "module.features.1.running_mean"
    assert saved[0][name]["digest"] != saved[1][name]["digest"]
    # The checkpoint holds rank 0's copy (DCP alone writes each replicated tensor from whichever rank
    # balances the load), read back by a plain script through `pilotrun convert`.
    conv = pilotrun_cli("convert", str(ckpt), "--out", str(tmp_path / "c.pt"), "--ledger", str(tmp_path / "l.sqlite"),
                        cwd=tmp_path)
    assert conv.returncode == 0, conv.stderr
    model = torch.load(tmp_path / "c.pt", weights_only=True)["model"]
    for buf in ("running_mean", "running_var"):
        assert _digest(model[f"features.1.{buf}"]) == saved[0][f"module.features.1.{buf}"]["digest"]

    # A buffer the checkpoint does not hold (persistent=False, changed by training, scales the logits) still fails.
    bad = tmp_path / "unsaved"
    res = pilotrun_cli(*args, "--set", "model.bug=unsaved_buffer", "--out", str(bad), cwd=tmp_path, timeout=600)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    reason = _restore_rows(json.loads((bad / "report.json").read_text()))[0]["reason"]
    assert ("buffer 'module.forwards' on ranks 0 and 1: it is registered with persistent=False, so state_dict() "
            "does not save it") in reason, reason
    assert "running_mean" not in reason, reason


@pytest.mark.process
def test_fsdp_names_unsynchronised_batchnorm_buffers_as_the_cause(tmp_path):
    # FSDP2 keeps each rank's buffers and nothing reconciles them: the checkpoint cannot hold both copies,
    # so the restore fails (a resumed rank would run with another rank's statistics) and says why.
    spec = copy_fixture("bncnn", tmp_path)
    res = pilotrun_cli("launch", "--nproc-per-node", "2", str(spec), "--set", "distributed.strategy=fsdp",
                       "--gates", "steady_step,save,restore", "--out", str(tmp_path / "out"),
                       "--ledger", str(tmp_path / "l.sqlite"), cwd=tmp_path, timeout=600)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    reason = _restore_rows(json.loads((tmp_path / "out" / "report.json").read_text()))[0]["reason"]
    assert "buffer 'features.1.running_mean' on rank" in reason and "the buffer was not restored" in reason, reason
    assert reason.count("FSDP2 neither shards nor synchronises buffers") == 1, reason
    assert "SyncBatchNorm.convert_sync_batchnorm" in reason


@pytest.mark.process
def test_sigterm_to_launch_is_recorded_by_the_ranks_as_an_interruption(toylm, tmp_path):
    # A preempted multi-process rental: SIGTERM reaches the launcher alone; it passes it to torchrun's ranks.
    import os
    import signal

    ledger = tmp_path / "l.sqlite"
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "pilotrun", "launch", "--nproc-per-node", "2", str(toylm), "--set",
           "distributed.strategy=ddp", "--ledger", str(ledger), "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("✓ first_step"):
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + proc.communicate(timeout=180)[0]
    assert proc.returncode == 143, out[-3000:]
    assert "interrupted (SIGTERM): run" in out and "continued by launching it again" in out
    with sqlite3.connect(ledger) as con:
        ((status, ended, meta),) = con.execute("SELECT status, ended_at, meta_json FROM runs").fetchall()
        ranks = {r for (r,) in con.execute("SELECT DISTINCT rank FROM gate_rows")}
    assert status == "interrupted" and ended and json.loads(meta)["interrupted_by"] == "SIGTERM"
    assert ranks == {0, 1}
