"""No process outlives its pilot (pilotrun/procs.py, pilotrun/keeper.py): a worker's or a program's children and
double-forked daemons are killed when the run ends, and a SIGKILLed pilotrun leaves nothing running. Real processes,
real SIGKILL, checked in /proc."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import TEST_DIGEST, write_spec

REPO = Path(__file__).resolve().parents[1]

# A child of its own, and a daemon that double-forks into a session of its own (escaping the process group), both
# sleeping far past the test; their pids written to ``pids``.
LEAVES_TWO = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open(PIDS + ".daemon", "w").write(str(os.getpid()))  # exec keeps the pid
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(301)"])
    os._exit(0)
while not os.path.exists(PIDS + ".daemon"):
    time.sleep(0.05)
time.sleep(0.3)  # the daemon's exec is done
open(PIDS, "w").write(f"{child.pid} {open(PIDS + '.daemon').read()}")
"""

def _pids(path: Path, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().split()) >= 2:
            return [int(p) for p in path.read_text().split()]
        time.sleep(0.1)
    pytest.fail(f"{path} was never written")


def _gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids still running (not zombies) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.process
def test_a_worker_that_ends_leaves_no_child_and_no_daemon_and_they_are_named(tmp_path, monkeypatch):
    from pilotrun.procs import Tree

    pids = tmp_path / "pids"
    (tmp_path / "leaves.py").write_text(f"PIDS = {str(pids)!r}\n" + LEAVES_TWO)
    with Tree([sys.executable, str(tmp_path / "leaves.py")], env=dict(os.environ), label="t") as tree:
        assert tree.wait(timeout=60) == 0
    left = _pids(pids)
    try:
        assert _gone(left) == [], "the worker's child or daemon is still running"
        assert sorted(p["pid"] for p in tree.ending.leftovers) == sorted(left)
        assert any("time.sleep(301)" in p["command"] for p in tree.ending.leftovers)
    finally:
        _kill(left)


@pytest.mark.process
def test_run_worker_kills_what_the_worker_left_and_keeps_its_result(tmp_path, monkeypatch):
    from pilotrun.workers.launch import run_worker

    pids = tmp_path / "pids"
    (tmp_path / "leaky_worker.py").write_text(
        f"PIDS = {str(pids)!r}\n" + LEAVES_TWO
        + "import json\nopen(sys.argv[sys.argv.index('--result') + 1], 'w').write(json.dumps({'ok': 1}))\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    payload = run_worker("leaky_worker", [], tmp_path / "r.json", tmp_path / "w.log", "leaky", timeout=60)
    left = _pids(pids)
    try:
        assert payload == {"ok": 1}
        assert _gone(left) == []
    finally:
        _kill(left)


def _sigkill_and_expect_gone(proc: subprocess.Popen, pids: Path, message: str) -> None:
    """Once the leaky child and daemon wrote their pids: SIGKILL ``proc`` alone, as the OOM killer would, and check
    that they and everything ``proc`` had started are gone."""
    try:
        left = _pids(pids)
        started = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert _gone(left + started) == [], message
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill(_pids(pids, 1) if pids.exists() else [])


@pytest.mark.process
def test_a_sigkilled_parent_takes_its_workers_children_and_daemons_with_it(tmp_path):
    """The worker was started with setsid; before the keeper, it ran on after its parent's SIGKILL."""
    pids = tmp_path / "pids"
    (tmp_path / "leaky_worker.py").write_text(f"PIDS = {str(pids)!r}\n" + LEAVES_TWO + "time.sleep(300)\n")
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom pathlib import Path\nfrom pilotrun.workers.launch import run_worker\n"
         f"run_worker('leaky_worker', [], Path({str(tmp_path / 'r.json')!r}), Path({str(tmp_path / 'w.log')!r}), "
         "'leaky', timeout=300)\n"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])})
    _sigkill_and_expect_gone(parent, pids, "a process of the killed parent's worker is still running")


@pytest.mark.process
def test_a_sigkilled_pilotrun_run_leaves_no_program_process(tmp_path):
    """`pilotrun run` on a program killed with SIGKILL mid-run: the program, its child and its daemon die too."""
    folder = tmp_path / "p"
    folder.mkdir()
    pids = tmp_path / "pids"
    (folder / "train.py").write_text(f"PIDS = {str(pids)!r}\nimport pilotrun\njob = pilotrun.program()\n"
                                     + LEAVES_TWO + "time.sleep(300)\n")
    spec = write_spec(folder / "pilot.yaml", {"name": "sleeper", "program": {"command": "python train.py"}})
    run = subprocess.Popen([sys.executable, "-m", "pilotrun", "run", str(spec), "--gates", "first_step", "--out",
                            str(tmp_path / "out"), "--ledger", str(tmp_path / "l.sqlite")], cwd=tmp_path,
                           env={**os.environ, "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST, "PYTHONPATH": str(REPO)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _sigkill_and_expect_gone(run, pids, "the program or what it started outlived the SIGKILLed pilotrun")


@pytest.mark.process
def test_a_killed_tree_reads_as_killed_by_sigkill_and_a_signal_reaches_the_command(tmp_path):
    from pilotrun.procs import Tree

    with Tree([sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ), label="t") as tree:
        time.sleep(0.3)
        tree.kill()
    assert tree.returncode == -signal.SIGKILL and tree.ending.killed
    with Tree([sys.executable, "-c", "import signal, sys, time\n"
               "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(7))\nopen('ready', 'w')\ntime.sleep(60)\n"],
              env=dict(os.environ), label="t", cwd=tmp_path) as tree:
        while not (tmp_path / "ready").exists():
            time.sleep(0.05)
        tree.send_signal(signal.SIGUSR1)  # the campaign's stop request
        assert tree.wait(timeout=30) == 7


# Kills its own keeper (its parent) once it has started two processes that carry no marker: a child in a session of
# its own with an empty environment, and a grandchild that did the same and whose parent exited (so the keeper, a
# subreaper, had adopted it). Then it sleeps on. Their pids are written to ``PIDS`` first.
KILLS_ITS_KEEPER = """\
import os, signal, subprocess, sys, time
child = subprocess.Popen(["sleep", "300"], env={}, start_new_session=True)
orphan = subprocess.run([sys.executable, "-c", "import subprocess\\n"
                         "print(subprocess.Popen(['sleep', '301'], env={}, start_new_session=True,\\n"
                         "                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
                        env={}, check=True, capture_output=True, text=True)
open(PIDS, "w").write(f"{child.pid} {orphan.stdout.strip()}")
os.kill(os.getppid(), signal.SIGKILL)
time.sleep(300)
"""


def _unmarked(pids: list[int]) -> None:
    """The processes KILLS_ITS_KEEPER started carry no marker: once the keeper is dead, nothing but this process's
    own subreaping finds them."""
    for pid in pids:
        assert "PILOTRUN_RUN_MARKER" not in psutil.Process(pid).environ()


@pytest.mark.process
def test_a_command_that_sigkills_its_keeper_leaves_nothing_running(tmp_path):
    """Found by the adversary: a program that SIGKILLed its keeper left its child running (no marker, no keeper
    above it). pilotrun, a subreaper itself, takes the orphans and kills them with the command."""
    from pilotrun.procs import Tree

    pids = tmp_path / "pids"
    (tmp_path / "kills.py").write_text(f"PIDS = {str(pids)!r}\n" + KILLS_ITS_KEEPER)
    tree = Tree([sys.executable, str(tmp_path / "kills.py")], env=dict(os.environ), label="t")
    try:
        assert tree.wait(timeout=60) == -signal.SIGKILL  # the keeper's own death
        left = _pids(pids)
        _unmarked(left)
        ending = tree.kill()
        assert _gone(left, 5) == [], "a process of the command that killed its keeper is still running"
        assert set(left) <= set(ending.killed) and not ending.survivors
    finally:
        tree.kill()
        _kill(_pids(pids, 1) if pids.exists() else [])


@pytest.mark.process
def test_a_program_run_whose_program_sigkills_its_keeper_is_reaped_whole_by_pilotrun(tmp_path):
    """The same through a program run, as `pilotrun run` starts one: the run ends when the keeper dies, and every
    process the program started is killed and named, none left for the leak check."""
    from pilotrun.config.program import ProgramSpec
    from pilotrun.program.env import Role
    from pilotrun.program.runner import RunPlan, run_program

    pids = tmp_path / "pids"
    (tmp_path / "train.py").write_text(f"PIDS = {str(pids)!r}\nimport pilotrun\njob = pilotrun.program()\n"
                                       + KILLS_ITS_KEEPER)
    try:
        outcome = run_program(ProgramSpec(command=["python", "train.py"], timeout=120.0), tmp_path,
                              RunPlan(Role.STAGES, stop_at=4), tmp_path / "out", "r1", tmp_path / "l.sqlite")
        left = _pids(pids, 1)
        assert _gone(left, 5) == [], "a process of the program that killed its keeper is still running"
        assert set(left) <= set(outcome.killed_pids) and not outcome.survivors
        assert not outcome.timed_out and outcome.returncode == -signal.SIGKILL
    finally:
        _kill(_pids(pids, 1) if pids.exists() else [])
