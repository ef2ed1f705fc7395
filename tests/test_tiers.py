"""The `process` mark is checked, not trusted: tests/conftest.py fails a test that starts a process without it.

Checked by running a small suite under our own conftest in a fresh pytest process: an unmarked test that starts a
subprocess, or calls os.system, fails naming the command; the same test marked passes; the lock gate's git probe
and a test that starts nothing pass unmarked; a misspelt mark is an error (markers are strict). A test that leaves
a temporary file or folder, in its own process or one it started, fails naming it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # runs pytest in a subprocess

SUITE = '''
import os
import subprocess
import sys

import pytest


def test_unmarked_subprocess():
    subprocess.run([sys.executable, "-c", "print('hello from a child')"], check=True)


def test_unmarked_system():
    os.system("true")


@pytest.mark.process
def test_marked_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_git_probe():
    subprocess.run(["git", "--version"], check=True, capture_output=True)


def test_unmarked_pure():
    assert sum(range(4)) == 6


def test_leaves_a_temporary_file():
    import tempfile

    os.close(tempfile.mkstemp(prefix="forgotten-")[0])


@pytest.mark.process
def test_a_child_leaves_a_temporary_folder():
    subprocess.run([sys.executable, "-c", "import tempfile; tempfile.mkdtemp(prefix='torchelastic_')"], check=True)


def test_cleans_up_its_temporary_file():
    import tempfile

    with tempfile.NamedTemporaryFile():
        pass
'''

MISSPELT = '''
import pytest


@pytest.mark.proces
def test_misspelt():
    pass
'''


def _suite(tmp_path: Path, body: str) -> Path:
    root = tmp_path / "suite"
    (root / "tests").mkdir(parents=True)
    shutil.copy(Path(__file__).with_name("conftest.py"), root / "tests" / "conftest.py")
    (root / "tests" / "test_suite.py").write_text(body)
    # The project's own pytest settings, markers and --strict-markers included.
    shutil.copy(Path(__file__).resolve().parents[1] / "pyproject.toml", root / "pyproject.toml")
    return root


def _pytest(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-rA", "--basetemp", str(root.parent / "basetemp"), "tests"], cwd=root, capture_output=True,
                          text=True, timeout=300)


def test_an_unmarked_test_that_starts_a_process_fails_naming_it(tmp_path):
    res = _pytest(_suite(tmp_path, SUITE))
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    outcomes = {}
    for line in out.splitlines():
        for word in ("PASSED", "FAILED", "ERROR"):
            if line.startswith(word + " ") and "::" in line:
                outcomes.setdefault(line.split("::")[1].split()[0], set()).add(word)
    assert outcomes["test_unmarked_subprocess"] == {"PASSED", "ERROR"}, out  # the test passed, its teardown fails
    assert outcomes["test_unmarked_system"] == {"PASSED", "ERROR"}, out
    for name in ("test_marked_subprocess", "test_unmarked_git_probe", "test_unmarked_pure",
                 "test_cleans_up_its_temporary_file"):
        assert outcomes[name] == {"PASSED"}, (name, out)
    # Temporary files left behind, by the test's own process or one it started, fail it too, named.
    assert outcomes["test_leaves_a_temporary_file"] == {"PASSED", "ERROR"}, out
    assert outcomes["test_a_child_leaves_a_temporary_folder"] == {"PASSED", "ERROR"}, out
    assert "the test left temporary files or folders: ['forgotten-" in out, out
    assert "the test left temporary files or folders: ['torchelastic_" in out, out
    assert "test_unmarked_subprocess started 1 process(es) but is not marked @pytest.mark.process" in out, out
    assert "-c print('hello from a child')" in out, out
    assert "os.system: true" in out, out


def test_a_misspelt_mark_is_an_error(tmp_path):
    res = _pytest(_suite(tmp_path, MISSPELT))
    assert res.returncode != 0
    assert "'proces' not found in `markers` configuration option" in res.stdout + res.stderr
