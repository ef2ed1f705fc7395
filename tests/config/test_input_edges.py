"""Bad input at the process's edges (issue 12, deliverable 3): the crash file, data files that are not
UTF-8 or not files, user code raising BaseException subclasses, the launcher's environment, seeds."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from pilotrun.data.jsonl import DataError, read_jsonl
from pilotrun.distributed import LaunchError, env_from_os
from pilotrun.train.rng import derived_seed
from tests.conftest import gate_rows


def test_the_crash_file_falls_back_to_the_temp_folder_and_says_where_it_could_not_go(tmp_path, monkeypatch):
    from pilotrun import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("a file where the runs/ folder would be")
    monkeypatch.setattr(cli.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    said = cli._save_crash("Traceback: boom")
    saved = tmp_path / "tmp" / f"pilotrun-crash-{os.getpid()}.txt"
    assert said == f"; traceback saved to {saved}" and saved.read_text() == "Traceback: boom"
    # Nowhere writable: the message names both places and why.
    monkeypatch.setattr(cli.tempfile, "gettempdir", lambda: str(tmp_path / "runs" / "under-a-file"))
    said = cli._save_crash("Traceback: boom")
    assert said.startswith("; the traceback could not be written to runs/pilotrun-crash.txt (")
    assert "under-a-file" in said


def test_non_utf8_jsonl_names_the_file_line_and_byte(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"id": 1, "text": "ok"}\n{"id": 2, "text": "caf\xe9"}\n')
    with pytest.raises(DataError) as info:
        read_jsonl(path, ("id", "text"))
    assert str(info.value) == f"{path}:2: not UTF-8 (byte 0xe9 at column 23); save the file as UTF-8"


def test_a_fifo_as_data_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    # Opening a FIFO with no writer blocks forever: the alarm turns a regression into a failure, not a hang.
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("read_jsonl opened the FIFO and blocked"))
    signal.alarm(5)
    try:
        with pytest.raises(DataError, match="not a regular file"):
            read_jsonl(fifo, ("id",))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


BOOM_ON_CALL = """from toy import build_data  # noqa: F401


class Boom(BaseException):
    pass


def build_model(cfg):
    raise {exc}("raised by the factory")
"""


def _with_factory(toy: Path, module: str, source: str) -> Path:
    """The toy spec with its model built by ``module``.build_model (``source``, written beside the toy's own)."""
    (toy.parent / f"{module}.py").write_text(source)
    spec = toy.parent / f"{module}.yaml"
    spec.write_text(toy.read_text().replace("toy:build_model", f"{module}:build_model"))
    return spec


def test_a_base_exception_from_a_factory_is_a_failed_gate(toy, tmp_path):
    rows = gate_rows(_with_factory(toy, "boom_model", BOOM_ON_CALL.format(exc="Boom")), tmp_path, gates=["load"])
    assert rows["load"]["verdict"] == "fail"
    assert rows["load"]["reason"].startswith("Boom: raised by the factory (at boom_model.py:9")


CTRL_C_ON_CALL = """import os
import signal
import time

from toy import build_data  # noqa: F401


def build_model(cfg):
    os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C arriving while the factory runs
    time.sleep(5)
"""


def test_ctrl_c_in_a_factory_still_interrupts_the_pilot(toy, tmp_path):
    # Python's own SIGINT handler, whatever this process inherited: pytest started as a shell's background job
    # inherits SIGINT ignored (POSIX), and a Ctrl-C the process ignores interrupts nothing (the pilot then failed
    # the load gate on the factory's None, not on the signal).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rows = gate_rows(_with_factory(toy, "ctrlc_model", CTRL_C_ON_CALL), tmp_path, gates=["load"])
    except KeyboardInterrupt:
        return
    finally:
        signal.signal(signal.SIGINT, inherited)
    pytest.fail(f"the pilot went on after a real SIGINT: {[(g, r['verdict'], r['reason']) for g, r in rows.items()]}; "
                f"SIGINT's handler {signal.getsignal(signal.SIGINT)!r}, blocked {signal.pthread_sigmask(signal.SIG_BLOCK, [])}")


def test_a_keyboard_interrupt_the_factory_raises_itself_is_the_load_gates_failure(toy, tmp_path):
    """No signal was sent: issue 22 found it recorded as "interrupted (Ctrl-C)"; it is the factory's own failure."""
    rows = gate_rows(_with_factory(toy, "raises_ki", BOOM_ON_CALL.format(exc="KeyboardInterrupt")), tmp_path,
                     gates=["load"])
    assert rows["load"]["verdict"] == "fail"
    assert "KeyboardInterrupt (at raises_ki.py:9 in build_model) though no stop signal" in rows["load"]["reason"]


@pytest.mark.parametrize("env, words", [
    ({"RANK": "abc"}, "$RANK='abc' is not an integer >= 0"),
    ({"RANK": "-1"}, "$RANK='-1' is not an integer >= 0"),
    ({"WORLD_SIZE": "0"}, "$WORLD_SIZE='0' is not an integer >= 1"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "$RANK=2 is not below $WORLD_SIZE=2"),
])
def test_the_launchers_environment_is_parsed_with_a_named_error(monkeypatch, env, words):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(LaunchError) as info:
        env_from_os()
    assert words in str(info.value)


def test_derived_seeds_fold_into_torchs_range_and_leave_in_range_values_alone():
    import torch

    assert derived_seed(12345) == 12345  # data orders of runs that worked before are unchanged
    top = (2**32 - 1) * 1_000_003 * 1_000_003 + 10**6  # the loader's seed for the largest spec seed
    assert top >= 2**64 and 0 <= derived_seed(top) < 2**64
    torch.Generator().manual_seed(derived_seed(top))  # raised "Overflow when unpacking long long" before
