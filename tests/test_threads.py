"""CPU threads that fit the cores a process shares (issue 48, item 7): the share, the environment every process
pilotrun starts gets, this process's own torch threads, and the note a timing row carries when the machine it was
timed on had more work than cores."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pilotrun import procs
from pilotrun.gates import steps
from pilotrun.gates.base import Outcome
from pilotrun.ledger.records import Verdict
from pilotrun.procs import HostLoad, Tree, command_processes, thread_env, thread_share

QUIET_8 = HostLoad(cpus=8, load_1min=0.5)
BUSY_2 = HostLoad(cpus=2, load_1min=3.3)  # this process and two others wanting the 2 cores


@pytest.fixture
def no_thread_vars(monkeypatch):
    for var in (*procs.THREAD_VARS, procs.WAIT_POLICY_VAR):
        monkeypatch.delenv(var, raising=False)


def test_thread_share_divides_the_cores_and_an_explicit_count_wins():
    assert thread_share(8) == 8
    assert thread_share(8, 4) == 2
    assert thread_share(8, 3) == 2  # whole threads, never more than the cores
    assert thread_share(2, 4) == 1  # never below one
    assert thread_share(0, 1) == 1
    assert thread_share(2, 4, explicit=6) == 6
    assert thread_share(8, 2, explicit=0) == 4  # 0 is no setting


def test_spare_cpus_take_off_the_load_of_other_processes():
    assert QUIET_8.spare_cpus() == 8
    assert HostLoad(cpus=8, load_1min=3.6).spare_cpus() == 5  # 4 busy, one of them this process
    assert BUSY_2.spare_cpus() == 1
    assert HostLoad(cpus=2, load_1min=9.0, load_is_ours=False).spare_cpus() == 2  # another CPU set's load
    assert HostLoad(cpus=4, load_1min=None).spare_cpus() == 4


def test_oversubscribed_only_when_the_load_exceeds_the_cores():
    assert BUSY_2.oversubscribed()
    assert not HostLoad(cpus=2, load_1min=2.0).oversubscribed()
    assert not HostLoad(cpus=2, load_1min=9.0, load_is_ours=False).oversubscribed()
    assert not HostLoad(cpus=2, load_1min=None).oversubscribed()
    text = steps.oversubscribed_text(BUSY_2)
    assert text is not None and "load 3.3" in text and "2 core(s)" in text and "not the job's" in text
    assert steps.oversubscribed_text(QUIET_8) is None


def test_thread_env_sets_the_share_unless_the_environment_has_one():
    env = thread_env({"PATH": "/bin"}, processes=2, host=QUIET_8)
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE"}
    env = thread_env({}, processes=1, host=BUSY_2)
    assert env["OMP_NUM_THREADS"] == "1"
    # The user's count wins, for MKL too; the user's wait policy is kept.
    env = thread_env({"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}, processes=2, host=QUIET_8)
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["OMP_WAIT_POLICY"]) == ("3", "3", "ACTIVE")
    env = thread_env({"OMP_NUM_THREADS": "lots"}, processes=2, host=QUIET_8)  # malformed: kept, MKL gets the share
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("lots", "4")
    # torchrun --nproc-per-node gpu: the count is the command's to choose.
    assert "OMP_NUM_THREADS" not in thread_env({}, processes=None, host=QUIET_8)


def test_command_processes_reads_torchruns_rank_count():
    py = sys.executable
    assert command_processes([py, "-m", "pilotrun.workers.reload", "--result", "r.json"]) == 1
    assert command_processes([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "x"]) == 4
    assert command_processes(["/usr/bin/torchrun", "--nproc_per_node", "2", "train.py"]) == 2
    assert command_processes(["torchrun", "--nproc-per-node", "gpu", "train.py"]) is None
    assert command_processes(["torchrun", "train.py"]) == 1
    assert command_processes(["bash", "-c", "torchrun --nproc-per-node=3 train.py"]) == 3


def test_fit_threads_gives_this_process_its_share(monkeypatch, no_thread_vars):
    before = torch.get_num_threads()
    monkeypatch.setattr(steps, "host_load", lambda: HostLoad(cpus=4, load_1min=2.2))  # one other busy process
    try:
        assert steps.fit_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a count the environment set: torch's own is kept
        torch.set_num_threads(1)
        assert steps.fit_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_timing_row_says_its_time_is_not_the_jobs_on_an_oversubscribed_machine(monkeypatch):
    monkeypatch.setattr(steps, "host_load", lambda: BUSY_2)
    out = Outcome(reason="20 ms/update over 6 update(s)")
    steps._timing(out, 1)
    assert out.verdict == Verdict.PASS  # a note, not a verdict: the job did nothing wrong
    assert out.reason.startswith("20 ms/update over 6 update(s); timed on an oversubscribed machine (load 3.3")
    assert out.details == {"cpu_threads": 1, "host_load_1min": 3.3, "host_cpus": 2, "oversubscribed": True}
    assert out.inputs == {"cpu_threads": 1}
    monkeypatch.setattr(steps, "host_load", lambda: QUIET_8)
    quiet = Outcome(reason="20 ms/update")
    steps._timing(quiet, 8)
    assert quiet.reason == "20 ms/update" and quiet.details["oversubscribed"] is False


ENV_OF_CHILD = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
                "('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OMP_WAIT_POLICY')}))")


def _child_env(env: dict) -> dict:
    with Tree([sys.executable, "-c", ENV_OF_CHILD], env=env, label="threads", stdout=subprocess.PIPE,
              text=True) as tree:
        out, _ = tree.proc.communicate(timeout=60)
    return json.loads(out)


@pytest.mark.process
def test_every_started_process_gets_its_share_and_an_explicit_count_wins(monkeypatch, no_thread_vars):
    """A Tree is how every worker, program run and campaign run starts: its command sees the count."""
    monkeypatch.setattr(procs, "host_load", lambda: HostLoad(cpus=6, load_1min=0.0))
    env = {"PATH": "/usr/bin:/bin"}
    assert _child_env(env) == {"OMP_NUM_THREADS": "6", "MKL_NUM_THREADS": "6", "OMP_WAIT_POLICY": "PASSIVE"}
    assert _child_env({**env, "OMP_NUM_THREADS": "2"}) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                                                           "OMP_WAIT_POLICY": "PASSIVE"}
