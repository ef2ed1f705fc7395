"""Shared fixtures. Every test is checked for leaks: child processes, process groups, files in the repo, temporary
files."""
from __future__ import annotations

import importlib
import json
import multiprocessing.util
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
IGNORED_DIRS = {".venv", ".venv-skypilot", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", "pilotrun.egg-info"}

# A well-formed image digest (pilotrun refuses a made-up one): tests that are not about the container pass it so the
# lock has a digest to record, whatever machine runs them.
TEST_DIGEST = "sha256:" + "5e" * 32

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Under pytest-xdist each of the N workers, and every process its tests start, gets its share of the cores, and
# OpenMP threads that wait sleep instead of spinning (set here, before torch is imported). N workers with a thread per
# core each oversubscribe the machine, and spinning threads then make small ops many times slower (the toy LM's overfit
# gate: 1 s alone, 19 s beside other busy processes); a campaign still gives each run its own thread count.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    from pilotrun.procs import THREAD_VARS, WAIT_POLICY_VAR, thread_share  # no torch: before its import

    for _var in THREAD_VARS:
        os.environ.setdefault(_var, str(thread_share(len(os.sched_getaffinity(0)), _WORKERS)))
    os.environ.setdefault(WAIT_POLICY_VAR, "PASSIVE")

# Importing torch._dynamo (the first optimizer step does) creates torch's compile cache folder, by default
# <tmp>/torchinductor_<user>, and sets TORCHINDUCTOR_CACHE_DIR for the process and its children. Settled once here,
# by torch's own function, before any test gives itself a temporary folder (no_leaks): otherwise that folder would
# be made inside whichever test first imports dynamo, read as its leak, and handed on to every later test's processes.
from torch._inductor.runtime.cache_dir_utils import cache_dir as _torch_cache_dir  # noqa: E402

_torch_cache_dir()


def _repo_files() -> set[str]:
    out = set()
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in IGNORED_DIRS and not d.endswith(".egg-info")]
        for f in files:
            if not f.endswith(".pyc"):
                out.add(os.path.relpath(os.path.join(root, f), REPO))
    return out


@pytest.fixture(scope="session")
def repo_files_before():
    return _repo_files()


@pytest.fixture(scope="session", autouse=True)
def shared_trace_cache(tmp_path_factory):
    """The estimator's traces (pilotrun.estimate.cache) in one folder for the session, never in ~/.cache. A trace
    depends only on its key and a hit answers what a miss does (test_estimate_cache), so the tests, and the xdist
    workers (the folder is above each worker's), share them: the 7B shapes several estimate tests ask for are traced
    once. A test about the cache itself sets its own PILOTRUN_CACHE."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "trace-cache"
    before = os.environ.get("PILOTRUN_CACHE")
    os.environ["PILOTRUN_CACHE"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("PILOTRUN_CACHE", None)
    else:
        os.environ["PILOTRUN_CACHE"] = before


# Every process a test starts inherits this mark, even one that escaped into its own session and
# was orphaned to init (torchrun starts each rank that way): the leak check finds it by the mark.
LEAK_MARK = "PILOTRUN_TEST_SESSION"
os.environ[LEAK_MARK] = str(os.getpid())


def _marked() -> dict[int, psutil.Process]:
    out = {}
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(LEAK_MARK) == os.environ[LEAK_MARK]:
                out[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


# -- the tiers -------------------------------------------------------------------------------------------------------
# `make test-fast` runs the tests without the `process` mark: pure logic in this process. Every test that starts a
# process (a subprocess, the CLI, a pilot whose restore/resume/reload_eval gates start workers, torchrun, Ray, a
# program pilot, a DataLoader worker) carries it; one that starts a process without it fails at teardown, naming what
# it started, so the fast tier stays fast as tests are added.
PROCESS_MARK = "process"
# Short probes in-process code makes that are not the process a test is about: the lock gate's `git rev-parse` and
# `git status` (milliseconds, a 10 s timeout), and `uname -p` behind platform.processor() (MLflow asks it; the answer
# is cached, so only the first test of a worker to ask starts it).
PROBES = frozenset({"git", "uname"})
_running: list[pytest.Item] = []
_started: dict[str, list[str]] = {}


def _note(what: str) -> None:
    if _running and _running[-1].get_closest_marker(PROCESS_MARK) is None:
        _started.setdefault(_running[-1].nodeid, []).append(what)


def _watch(module, name: str, describe) -> None:
    real = getattr(module, name)

    def watched(*args, **kwargs):
        what = describe(*args, **kwargs)
        if what is not None:
            _note(what)
        return real(*args, **kwargs)

    # Pickled by reference under the name it replaces (a test pickles os.system itself).
    watched.__module__, watched.__name__ = getattr(module, "__module__", module.__name__), name
    watched.__qualname__ = f"{module.__qualname__}.{name}" if isinstance(module, type) else name
    setattr(module, name, watched)


def _popen_words(self, args, *rest, **kwargs) -> str | None:
    words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    program = kwargs.get("executable") or (words[0] if words else "")
    if not kwargs.get("shell") and os.path.basename(os.fsdecode(program)) in PROBES:
        return None
    return "subprocess: " + " ".join(os.fsdecode(w) for w in words)[:200]


_watch(subprocess.Popen, "__init__", _popen_words)
_watch(os, "fork", lambda: "os.fork() (multiprocessing with fork, a DataLoader worker)")
_watch(os, "posix_spawn", lambda path, *a, **k: f"os.posix_spawn: {path}")
_watch(os, "posix_spawnp", lambda path, *a, **k: f"os.posix_spawnp: {path}")
_watch(os, "system", lambda command: f"os.system: {command}")
_watch(multiprocessing.util, "spawnv_passfds", lambda path, args, fds: f"multiprocessing spawn: {os.fsdecode(path)}")


# The modules that take longest under `make test` (seconds of test time on 2 cores, measured 2026-12-02 with run and
# campaign in the test's process), longest first. `make test` keeps each module on one worker (--dist loadfile: a
# module-scoped fixture, such as test_campaign's one real campaign or the killed pilot the loading-policy tests resume,
# runs once) and hands the modules out in this order, so the long ones start first and the short ones fill in at the
# end. Only an order: a module not listed runs after these, a stale figure costs minutes, never a result.
LONGEST_MODULES = {
    "test_campaign_ray.py": 157, "test_integration_examples.py": 143, "test_distributed.py": 122, "test_campaign.py": 75,
    "test_integration_accelerate.py": 68, "test_program_pilot.py": 68, "test_estimate.py": 66, "test_cli.py": 51,
    "test_checkpoint_restore_resume.py": 51, "test_campaign_program.py": 35, "test_adapters.py": 35,
    "test_skypilot.py": 30, "test_estimate_adapters.py": 27, "test_resume_damage.py": 24,
    "test_gates_data_and_accumulation.py": 23, "test_program_estimate.py": 22, "test_spec_fuzz.py": 16,
    "test_gpu_check.py": 15, "test_launch_multinode.py": 15, "test_variants.py": 14, "test_estimate_cache.py": 14,
    "test_pilot_toy.py": 13,
}


def pytest_collection_modifyitems(config, items):
    """The longest modules first (LONGEST_MODULES), each module's tests in their own order."""
    items.sort(key=lambda item: -LONGEST_MODULES.get(item.path.name, 0))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    started = _started.pop(item.nodeid, None) if call.when == "teardown" else None
    if not started:
        return
    message = (f"{item.nodeid} started {len(started)} process(es) but is not marked @pytest.mark.{PROCESS_MARK} "
               f"(`make test-fast` would run it): " + "; ".join(started[:5]))
    if report.failed:
        report.sections.append(("unmarked process", message))
    else:
        report.outcome = "failed"
        report.longrepr = message


# Signals whose handlers a test must leave as it found them: a handler left behind changes what the next test on
# the same xdist worker sees (a SIGINT left ignored made a later test's real Ctrl-C do nothing).
WATCHED_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGUSR1")
                        if hasattr(signal, n))


def _handlers() -> dict:
    return {sig: signal.getsignal(sig) for sig in WATCHED_SIGNALS}


@pytest.fixture(autouse=True)
def no_leaks(repo_files_before, tmp_path_factory, monkeypatch):
    """Fail a test that leaves processes (children or orphans it started), a process group, repo files, temporary
    files, a signal handler or an interval timer."""
    # The test's temporary folder, for this process (tempfile caches its choice) and every process it starts
    # (TMPDIR): whatever pilotrun's code leaves there (a temp file, torchrun's torchelastic_* folder) is a leak.
    scratch = tmp_path_factory.mktemp("scratch")
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    before_children = {p.pid for p in psutil.Process().children(recursive=True)} | set(_marked())
    handlers, mask = _handlers(), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    mask_now = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    changed = {signal.Signals(sig).name: (handlers[sig], now) for sig, now in _handlers().items()
               if now != handlers[sig]}
    for name, (was, _) in changed.items():
        signal.signal(getattr(signal, name), was)
    timer = signal.setitimer(signal.ITIMER_REAL, 0)
    import torch.distributed as dist

    leaked_pg = dist.is_available() and dist.is_initialized()
    if leaked_pg:
        dist.destroy_process_group()
    found = {p.pid: p for p in psutil.Process().children(recursive=True)} | _marked()
    children = [p for pid, p in found.items() if pid not in before_children]
    alive = []
    for p in children:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    left = []
    for p in alive:
        try:
            left.append(p.cmdline())  # read before the kill: a killed child is a zombie, whose cmdline psutil refuses
        except psutil.Error:
            left.append([f"pid {p.pid}"])
        p.kill()
    new_files = _repo_files() - repo_files_before
    temporary = sorted(p.name for p in scratch.iterdir())
    assert not leaked_pg, "the test left a torch.distributed process group initialised"
    assert not alive, f"the test left child processes running: {left}"
    assert not new_files, f"the test wrote into the repository: {sorted(new_files)[:10]}"
    assert not temporary, f"the test left temporary files or folders: {temporary[:10]}"
    assert not changed, f"the test left signal handlers changed (now put back): {changed}"
    assert timer == (0.0, 0.0), f"the test left an interval timer running (now stopped): {timer}"
    assert mask_now == mask, f"the test left signals blocked (now unblocked): {sorted(mask_now - mask)}"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run in a temporary folder so runs/ and the default ledger land there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PILOTRUN_LEDGER", raising=False)
    monkeypatch.delenv("PILOTRUN_CONTAINER_DIGEST", raising=False)
    return tmp_path


def copy_example(name: str, dest: Path) -> Path:
    """A copy of an example outside the git checkout (so its lock is not 'dirty')."""
    target = dest / name
    shutil.copytree(EXAMPLES / name, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target / "pilot.yaml"


def planted_example(name: str, folder: Path, patches: dict[str, str] | None = None, script: str = "train.py") -> Path:
    """A copy of an example at ``folder`` with ``patches`` (old text -> new text) planted in its script; each old
    text must still be there (an edited example must not silently drop a planted defect). Returns the folder."""
    shutil.copytree(EXAMPLES / name, folder, ignore=shutil.ignore_patterns("__pycache__", "checkpoints"))
    src = (folder / script).read_text()
    for old, new in (patches or {}).items():
        assert old in src, f"the example changed: {old!r} is not in {script} any more"
        src = src.replace(old, new)
    (folder / script).write_text(src)
    return folder


def copy_fixture(name: str, dest: Path) -> Path:
    target = dest / name
    shutil.copytree(FIXTURES / name, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target / "pilot.yaml"


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# The gates in the order of docs/reference/gates.md, written out independently of the code under test.
SPEC_ORDER = ["lock", "inspect", "split", "batch", "load", "first_step", "steady_step", "accum_equivalence", "eval",
              "save", "export", "restore", "resume", "overfit", "reload_eval"]


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A user's own classifier and data in plain PyTorch (tests/fixtures/toy)."""
    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    return copy_fixture("toy", tmp_path)


@pytest.fixture
def toylm(tmp_path, monkeypatch):
    """A user's own causal LM and SFT-style data in plain PyTorch (tests/fixtures/toylm)."""
    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    return copy_fixture("toylm", tmp_path)


DATA_WAIT_WARN = "of update time is spent waiting on data"


def steady_verdicts(rows: dict) -> dict[str, str]:
    """Each gate's verdict, with the one that depends on the machine read as a pass: a tiny model's 2 ms updates,
    descheduled on a loaded machine while a batch is fetched, can spend over 10% of their time waiting on data, and
    steady_step warns, naming it (seen in parallel runs of the suite on 2 cores). Any other warn stays a warn."""
    out = {g: r["verdict"] for g, r in rows.items()}
    if out.get("steady_step") == "warn" and DATA_WAIT_WARN in rows["steady_step"]["reason"]:
        out["steady_step"] = "pass"
    return out


def gate_rows(spec_path, tmp_path, *overrides, gates=None) -> dict:
    """Run a pilot in this process; rows by gate name."""
    from pilotrun.config import load_spec
    from pilotrun.pilot import PilotOptions, run_pilot

    spec = load_spec(spec_path, list(overrides))
    result = run_pilot(spec, PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "l.sqlite", gates=gates))
    return {r["gate"]: r for r in result.rows}


# Commands pilotrun_cli runs through ``pilotrun.cli.main`` in the test's process: the same parser, error handling and
# exit codes, the output as a pipe would get it, without the interpreter start and imports a subprocess pays (1.2 s
# of CPU for torch, 3-4 s with transformers; on 2 cores the suite is bound by CPU, not by waiting). `run` and
# `campaign` are among them: a pilot's gates already run in the test's process through gate_rows, and the leak check
# (no_leaks) fails a call that leaves a signal handler, a timer, a blocked signal, a process group or a process
# behind. A real subprocess is kept for `launch` (torchrun), for a call whose ``env`` changes a variable that is not
# pilotrun's own (libraries read theirs at import: HF_HUB_CACHE, RAY_*), and for every call a test signals (those
# use Popen, not this helper).
IN_PROCESS = frozenset({"ledger", "report", "select", "plan", "batch", "inspect", "convert", "archive", "note",
                        "estimate", "lock", "variants", "run", "campaign"})
_CLI_ENV = {"PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST, "COLUMNS": "200"}


def _read_at_call(env: dict | None) -> bool:
    """Whether a subprocess would see nothing this process cannot give the call: every variable of ``env`` is one
    pilotrun reads when a command runs (PILOTRUN_*), or already has that value here (HF_HUB_OFFLINE=1)."""
    return all(k.startswith("PILOTRUN_") or os.environ.get(k) == v for k, v in (env or {}).items())


# Where the in-process watchdog writes the stacks of a call that hangs: this worker's real stderr, duplicated at
# configure time, before pytest captures fd 2 (inside a test the dump would land in a capture file nobody reads).
# None when pytest's own per-test timer is set (-o faulthandler_timeout=N): a process has one timer, left to pytest.
_WATCHDOG_FILE: list = [None]


def pytest_configure(config):
    if not float(config.getini("faulthandler_timeout") or 0):
        _WATCHDOG_FILE[0] = os.fdopen(os.dup(2), "w")


def _cli_in_process(args: list[str], cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    import contextlib
    import faulthandler
    import io

    from pilotrun.cli import common, main

    out, err = io.StringIO(), io.StringIO()
    call_env = {**_CLI_ENV, **(env or {})}
    saved_env = {k: os.environ.get(k) for k in call_env}
    saved_cwd = os.getcwd()
    os.environ.update(call_env)
    common.err_console.cache_clear()  # built once per process: built again for this call's stderr and width
    try:
        # The subprocess's timeout, kept: under xdist, a call that hangs ends this worker with every thread's stack on
        # its stderr (xdist reports the test as failed and starts a new worker) instead of holding CI until its limit;
        # run without xdist, it ends the session the same way.
        if _WATCHDOG_FILE[0] is not None:
            faulthandler.dump_traceback_later(timeout, exit=True, file=_WATCHDOG_FILE[0])
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as exc:  # argparse's usage errors and --help
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        if _WATCHDOG_FILE[0] is not None:
            faulthandler.cancel_dump_traceback_later()
        os.chdir(saved_cwd)
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        common.err_console.cache_clear()
    return subprocess.CompletedProcess([sys.executable, "-m", "pilotrun", *args], code, out.getvalue(), err.getvalue())


def pilotrun_cli(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real command line: ``pilotrun.cli.main`` in this process for the IN_PROCESS commands (with no ``env``, or
    one a subprocess would not see differently: _read_at_call), else a real subprocess."""
    if args and args[0] in IN_PROCESS and _read_at_call(env):
        return _cli_in_process(list(args), cwd, timeout, env)
    full_env = {**os.environ, **_CLI_ENV, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pilotrun", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium() -> str | None:
    return next((shutil.which(n) for n in CHROMIUM_NAMES if shutil.which(n)), None)


NO_CHROMIUM = ("no Chromium on PATH: the page was NOT opened in a browser (install Debian's `chromium` package: "
               "apt-get install chromium; .ci/run installs it when it can)")


def pytest_runtest_setup(item) -> None:
    """A test marked ``browser`` is skipped, saying so, where no Chromium is on PATH: the skip is declared on the
    test, never raised from inside one that checks other things too."""
    if item.get_closest_marker("browser") is not None and chromium() is None:
        pytest.skip(NO_CHROMIUM)


def require(module: str, distribution: str):
    """Import an optional dependency the dev extra installs; its absence fails the collection (a broken optional
    install is a red run, never a green one with tests skipped)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{distribution} is not importable ({exc}), though the dev extra installs it: "
                    "pip install -e '.[dev]'", pytrace=False)


def open_in_chromium(html: Path, work: Path) -> tuple[str, list[str], Path]:
    """Open a file in real headless Chromium: the DOM after scripts ran, the page's console errors, a screenshot.
    Only for tests marked ``@pytest.mark.browser`` (they are skipped beforehand where no Chromium is on PATH)."""
    exe = chromium()
    if exe is None:
        pytest.fail("open_in_chromium in a test not marked @pytest.mark.browser: " + NO_CHROMIUM, pytrace=False)
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={work / 'chromium-profile'}",
             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000"]
    dom = subprocess.run(flags + ["--dump-dom", html.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    shot = work / (html.stem + ".png")
    subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1200,2400", html.resolve().as_uri()],
                   capture_output=True, text=True, timeout=120)
    console = [line for line in (dom.stderr or "").splitlines() if ":CONSOLE" in line]
    return dom.stdout, console, shot


def killed_after_export(spec: Path, tmp_path: Path, ledger: Path, *extra: str) -> dict:
    """A real pilot killed with SIGKILL right after its export gate (restore was next): a resumable parent."""
    from pilotrun.ledger import Ledger

    env = {**os.environ, "PILOTRUN_CONTAINER_DIGEST": TEST_DIGEST, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "pilotrun", "run", str(spec), "--ledger", str(ledger), *extra]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("✓ export"):
            # Stopped first, so it cannot start the next gate's worker between listing its children and the kill
            # (that worker, in a session of its own, then outlived the test: the leak check failed now and then).
            proc.send_signal(signal.SIGSTOP)
            tree = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(signal.SIGKILL)
            for p in tree:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            break
    proc.wait(timeout=60)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    with Ledger(ledger) as led:
        parent = led.runs()[0]
    assert parent["status"] == "running"
    return parent


def program_handle(tmp_path: Path, role: str, **env):
    """A ProgramHandle as a pilot's ``role`` run sees it (events and checkpoints under tmp_path), for the integration
    tests that drive a Trainer in this process; ``env`` sets more of pilotrun.program.env's variables by name."""
    from pilotrun.program import env as E
    from pilotrun.program.handle import ProgramHandle

    environ = {E.PROGRAM: "1", E.ROLE: role, E.RUN_ID: "test", E.EVENTS: str(tmp_path / "events"),
               E.CHECKPOINT_DIR: str(tmp_path / role)}
    environ.update({getattr(E, k.upper()): str(v) for k, v in env.items()})
    return ProgramHandle(environ=environ)


def program_events(job, kind: str) -> list[dict]:
    """The events of one kind a handle wrote."""
    assert job.events_path is not None
    return [x for x in map(json.loads, job.events_path.read_text().splitlines()) if x["kind"] == kind]


def ledger_rows(ledger: Path, sql: str, *args) -> list[dict]:
    """The rows of ``sql`` in the ledger file, each a dict by column: the tests read what pilotrun wrote with plain
    SQL, not through the code under test."""
    with sqlite3.connect(ledger) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(sql, args)]


def polled_rows(ledger: Path, sql: str, *args) -> list[dict]:
    """:func:`ledger_rows` of a ledger another process may still be creating: no file yet, or a file whose tables
    its creator has not yet written (``Ledger`` makes the file, then its schema), is no rows. Connecting before the
    file exists would create it, so that is not tried."""
    if not ledger.exists():
        return []
    try:
        return ledger_rows(ledger, sql, *args)
    except sqlite3.OperationalError as exc:
        if "no such table" not in str(exc):
            raise
        return []


def interrupt_when(cmd: list[str], ready, cwd: Path, env: dict, timeout: float = 120) -> tuple[int, str]:
    """Run ``cmd``, SIGINT it once ``ready()`` is true (polled), and return its exit code and output; the process is
    killed if it ends early, stalls past ``timeout`` or the test fails, never left running."""
    import time

    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, f"{cmd[3:5]} ended before it could be interrupted"
            assert time.monotonic() < deadline, f"{cmd[3:5]} did not get there in {timeout} s"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out
