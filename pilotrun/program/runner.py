"""Run the user's program once, in one role: its command, its environment, its process tree, its events.

The command runs from the spec's folder; a first word ``python``/``python3`` becomes this interpreter and
``torchrun`` becomes ``python -m torch.distributed.run`` (so the program sees the packages pilotrun sees, pilotrun
itself included). Its output goes to ``<out>/program/<role>.log``. The interrupted run is killed with SIGKILL once
rank 0 reports ``saved(N)``. Every run gets a fresh secret key (``RunPlan.key``, passed as ``$PILOTRUN_EVENTS_KEY``
and kept in ``<out>/program/runs/<role>.key`` for ``--resume`` and a campaign's continuation): only event lines signed
with it are read back (:class:`EventCheck`). Every run is under a keeper (``pilotrun/procs.py``): whatever it
started, torchrun's ranks in their own sessions and a daemon that double-forks included, is killed when the run ends,
however it ends; what a run that ended by itself left running is named (``RunOutcome.leftovers``), so its row can
warn.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..config.program import (
    ACCELERATE_MODULE,
    ACCELERATE_WORDS,
    FABRIC_MODULE,
    FABRIC_WORDS,
    PYTHON_WORDS,
    TORCHRUN_MODULE,
    TORCHRUN_WORD,
    ProgramSpec,
)
from ..ledger.records import GateRow
from ..procs import KILL_WAIT_S, Tree, leftover_text, with_torchrun_folder
from ..safefile import FileKind, FileProblem, read_bytes
from . import env as E
from .env import Event, Role, UpdateRecord

POLL_S = 0.02
# Variables of an enclosing torchrun that must not leak into the program's own launch.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def command_words(words: list[str]) -> list[str]:
    """The command with python and its launchers (torchrun, accelerate launch, fabric run) resolved to this
    interpreter."""
    if words and words[0] in PYTHON_WORDS:
        return [sys.executable, *words[1:]]
    if words and words[0] == TORCHRUN_WORD:
        return [sys.executable, "-m", TORCHRUN_MODULE, *words[1:]]
    if tuple(words[:2]) == ACCELERATE_WORDS:
        return [sys.executable, "-m", ACCELERATE_MODULE, *words[2:]]
    if tuple(words[:2]) == FABRIC_WORDS:
        return [sys.executable, "-m", FABRIC_MODULE, *words[2:]]
    return list(words)


# An event line is a few hundred bytes; a million updates fit well within this.
EVENTS_CAP = 512 << 20
# What each kind must carry for the rows to read it (the handle writes them so; a hand-written file may not).
EVENT_FIELDS: dict[str, tuple[str, type]] = {Event.UPDATE: ("update", int), Event.SAVED: ("update", int),
                                             Event.STAGE: ("row", dict), Event.GATE: ("row", dict)}


class EventCheck:
    """Which lines of one event file are events of this run: JSON objects of a known shape (:data:`EVENT_FIELDS`),
    signed with the run's key (``key``; None: none is, the key was lost), of the file's rank, and not a repeat of a
    line their writer already wrote. Every line left out, and a gap in a writer's numbers, is named in ``problems``."""

    def __init__(self, path: Path, key: bytes | None, rank: int | None = None,
                 problems: list[str] | None = None) -> None:
        self.path, self.key, self.rank = path, key, rank
        self.problems: list[str] = [] if problems is None else problems
        self.last: dict[str, int] = {}  # writer -> the last number read from it

    def take(self, line: str, number: int, last: bool = False) -> dict | None:
        """The event on line ``number``, or None (named in ``problems``, except a ``last`` line that is not JSON:
        cut by SIGKILL mid-write)."""
        body, why = self._signed(line, last)
        if body is not None:
            event = json.loads(body)  # the signed text itself, not the line around it
            turn = self._out_of_turn(event)
            if turn is None:
                return event
            why = turn
        if why:
            self.problems.append(f"{self.path} line {number} {why}: left out")
        return None

    def _signed(self, line: str, last: bool) -> tuple[str | None, str]:
        """(the signed text of a well-formed event line, "") or (None, why not; "" for a last line cut mid-write)."""
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):
            return None, "" if last else "is not JSON"
        why = _not_an_event(event)
        if why:
            return None, why
        body = E.signed_body(self.key, line) if self.key is not None else None
        if body is None:
            return None, ("is not signed with this run's key (the program's pilotrun.program() handle signs every "
                          "line: something else wrote it into the event file)")
        return body, ""

    def _out_of_turn(self, event: dict) -> str | None:
        """Why a signed line is still not this file's next event from its writer (a line copied from another rank's
        file or repeated); a gap before it is named, and the line kept."""
        if self.rank is not None and event.get("rank") != self.rank:
            return f"is rank {event.get('rank')!r}'s event, in rank {self.rank}'s file"
        writer, seq = event.get("writer"), event.get("seq")
        if not isinstance(writer, str) or isinstance(seq, bool) or not isinstance(seq, int):
            return "carries no writer and number"
        before = self.last.get(writer)
        if before is not None and seq <= before:
            return f"repeats number {seq} of its writer (already read up to {before})"
        if before is not None and seq > before + 1:
            self.problems.append(f"{self.path}: {seq - before - 1} line(s) of writer {writer} before number {seq} "
                                 "are missing (removed from the event file?)")
        self.last[writer] = seq
        return None


def read_events(path: Path, key: bytes | None, problems: list[str] | None = None,
                rank: int | None = None) -> list[dict]:
    """The events of one file that this run's handle signed with ``key`` (:class:`EventCheck`); a last line cut by
    SIGKILL is dropped (every other line is whole). A line left out is named in ``problems``."""
    try:
        text = read_bytes(path, EVENTS_CAP).decode("utf-8", errors="replace")
    except FileProblem as exc:
        if problems is not None and exc.kind != FileKind.MISSING:
            problems.append(f"the event file {exc}: not read")
        return []
    check, lines = EventCheck(path, key, rank, problems), text.splitlines()
    return [e for number, line in enumerate(lines, 1) if (e := check.take(line, number, number == len(lines)))]


def _not_an_event(event: object) -> str | None:
    if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
        return "is not an event (a JSON object with a string 'kind')"
    field_type = EVENT_FIELDS.get(event["kind"])
    if field_type and (not isinstance(event.get(field_type[0]), field_type[1]) or isinstance(event.get(field_type[0]),
                                                                                             bool)):
        return f"is a {event['kind']!r} event whose {field_type[0]!r} is not {field_type[1].__name__}"
    if event["kind"] in (Event.STAGE, Event.GATE):  # read as a GateRow from here on: its shape is checked here
        try:
            GateRow.from_mapping(event["row"])
        except (TypeError, ValueError, AttributeError) as exc:
            return f"is a {event['kind']!r} event whose row is not a gate row ({str(exc)[:120]})"
    return None


def read_rank_events(events_dir: Path, role: Role, problems: list[str], key: bytes | None) -> dict[int, list[dict]]:
    """rank -> its events, from ``<role>-rank<N>.jsonl``, signed with ``key``; a file of another name is named in
    ``problems``."""
    pattern = re.compile(rf"^{re.escape(str(role))}-rank(\d{{1,6}})\.jsonl$")
    out = {}
    for path in sorted(events_dir.glob(f"{role}-rank*.jsonl")):
        match = pattern.match(path.name)
        if match is None:
            problems.append(f"{path} is not named <role>-rank<N>.jsonl: left out")
            continue
        out[int(match.group(1))] = read_events(path, key, problems, rank=int(match.group(1)))
    return out


# The key file of a run: only its owner may read it (a run's folder may be shared).
KEY_MODE = 0o600


def _keep_key(base: Path, role: Role, key: bytes) -> None:
    folder = base / "runs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{role}.key"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_MODE)
    with os.fdopen(fd, "w") as fh:
        fh.write(key.hex())


def kept_key(out_dir: Path, role: Role) -> bytes | None:
    """The key the last run of ``role`` in ``out_dir`` signed its events with; None when it was not kept (a run
    before keys, or the file is not one)."""
    try:
        return bytes.fromhex(read_bytes(out_dir.resolve() / "program" / "runs" / f"{role}.key", 256).decode())
    except (FileProblem, ValueError):
        return None


def kept_events(out_dir: Path, role: Role, rank: int = 0, problems: list[str] | None = None) -> list[dict]:
    """The events of rank ``rank`` of the last run of ``role`` in ``out_dir``, checked against its kept key (after
    the process that ran it is gone: a campaign continuing a run its killed campaign left)."""
    path = out_dir.resolve() / "program" / "events" / f"{role}-rank{rank}.jsonl"
    return read_events(path, kept_key(out_dir, role), problems, rank=rank)


@dataclass
class RunOutcome:
    """One run of the program: how it ended and what each rank reported."""

    role: Role
    returncode: int | None
    seconds: float
    log: Path
    events: dict[int, list[dict]] = field(default_factory=dict)  # rank -> its events in order
    killed: bool = False        # SIGKILLed by pilotrun after its save (the interrupted run)
    killed_pids: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)  # pids still alive KILL_WAIT_S after SIGKILL
    leftovers: list[dict] = field(default_factory=list)  # {pid, command} the program left running when it ended
    event_problems: list[str] = field(default_factory=list)  # lines and files of its events that were left out
    timed_out: bool = False

    def of(self, kind: Event, rank: int | None = None) -> list[dict]:
        ranks = sorted(self.events) if rank is None else [rank]
        return [e for r in ranks for e in self.events.get(r, []) if e.get("kind") == kind]

    def updates(self, rank: int) -> list[UpdateRecord]:
        """The rank's ``job.update`` events, typed (their fields were checked when the events were read)."""
        return [UpdateRecord.from_json(e) for e in self.of(Event.UPDATE, rank)]

    @property
    def ranks(self) -> list[int]:
        return sorted(self.events)

    @property
    def world_size(self) -> int:
        """The processes the run started, as their handles reported them (1 without a start event)."""
        return max([int(e.get("world_size") or 1) for e in self.of(Event.START)] + [len(self.events), 1])

    @property
    def ended_cleanly(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def how_it_ended(self) -> str:
        if self.survivors:
            return (f"was killed with SIGKILL but processes {self.survivors} were still alive {KILL_WAIT_S:g} s later "
                    "(stuck in the kernel: check them with ps before piloting again)")
        if self.timed_out:
            return ("ran past program.timeout and was killed (does it end when job.should_stop(update) is True, and "
                    "save when job.should_save(update) is?)")
        if self.killed:
            return "was killed with SIGKILL after its save, as planned"
        return f"exited with {self.returncode}" + (f": {self.log_tail()}" if self.returncode else "")

    def leftover_text(self) -> str:
        """The processes the program left running when it ended (each killed since), for a row's reason."""
        return leftover_text(self.leftovers)

    def raised(self) -> str | None:
        """The class name of the last exception the run's log shows, None without one (or without a log)."""
        try:
            return exception_type(self.log.read_text(errors="replace"))
        except OSError:
            return None

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return failure_lines(text, lines)


# torchrun's own report of a failed rank: the lines after it are its traceback and a summary, not the rank's error.
TORCHRUN_FAILED = "torch/distributed/elastic/multiprocessing/api.py"


def failure_lines(text: str, lines: int = 3) -> str:
    """The lines of a program's log that say why it failed: its last exception whole (type and message) when it
    raised one; else its last lines; under torchrun, what the ranks printed before torchrun reported the failure
    (their last exception, or last lines) and torchrun's line naming the failed rank and exit code."""
    all_lines = [line for line in text.strip().splitlines() if line.strip().strip("*")]  # not torchrun's banner
    first = next((i for i, line in enumerate(all_lines) if TORCHRUN_FAILED in line), None)
    if first is None:
        return last_exception(all_lines) or _tail(" | ".join(all_lines[-lines:])) or "(empty log)"
    # Found piloting a 2-rank loop whose rank 1 aborted: the row quoted torchrun's summary ("error_file: <N/A> |
    # traceback : Signal 6 ...") instead of the rank's "terminate called without an active exception".
    failed = next((line for line in all_lines[first:] if "failed (exitcode" in line), "")
    raised = last_exception(all_lines[:first])
    rank_said = [raised] if raised else all_lines[max(0, first - (lines - 1)):first]
    shown = [*rank_said, failed.split("] ", 1)[-1]] if failed else rank_said
    return _tail(" | ".join(shown)) or "(empty log)"


TRACEBACK = "Traceback (most recent call last):"
_RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:\s?")   # torchrun's --tee / LOGLEVEL prefixes
_LOG_LINE = re.compile(r"^([WEIF]\d{4} |\[[WEI] |\d{4}-\d\d-\d\d[ T]|Exception ignored)")   # a new log record
EXCEPTION_CHARS = 800


def last_exception(lines: list[str]) -> str | None:
    """The last exception a Python traceback in ``lines`` ended with, whole: its type and its message, every line
    of it (a multi-line message joined), never cut mid-word. None when no traceback is there.

    Found piloting a program whose resume failed in torch.load: the row showed the last 400 characters of the log,
    starting mid-word ("ialization.add_safe_globals(..."), without the exception's type."""
    plain = [_RANK_PREFIX.sub("", line) for line in lines]
    starts = [i for i, line in enumerate(plain) if line.strip().endswith(TRACEBACK)]
    if not starts:
        return None
    said: list[str] = []
    for line in plain[starts[-1] + 1:]:
        if not said:
            if line[:1] in (" ", "\t") or not line.strip():   # the frames and their source lines
                continue
        elif _LOG_LINE.match(line) or line.strip().endswith(TRACEBACK):
            break
        if line.strip():
            said.append(line.strip())
    return _tail(" ".join(said), EXCEPTION_CHARS, keep="head") if said else None


def _tail(text: str, limit: int = 400, keep: str = "tail") -> str:
    """``text`` within ``limit`` characters, cut at a word boundary and marked with an ellipsis."""
    if len(text) <= limit:
        return text
    if keep == "head":
        return text[:limit].rsplit(" ", 1)[0] + " …"
    return "… " + text[-limit:].split(" ", 1)[-1]


def exception_type(text: str) -> str | None:
    """The class name of the last exception in a log (``FileNotFoundError``), None without one."""
    raised = last_exception(text.splitlines())
    head = raised.split(":", 1)[0].strip() if raised else ""
    return head.rsplit(".", 1)[-1] if head and " " not in head else None


# How each run ended, beside its events: what `pilotrun run --resume` reads to reuse the runs an interrupted pilot
# finished (the events alone do not say whether a run ended cleanly, was killed as planned, or timed out).
OUTCOME_FIELDS = ("returncode", "seconds", "killed", "killed_pids", "survivors", "leftovers", "event_problems",
                  "timed_out")


def _record(base: Path, outcome: RunOutcome, run_id: str) -> None:
    from ..safefile import WriteFailed, write_atomic

    folder = base / "runs"
    record = {"role": str(outcome.role), "run_id": run_id, "log": str(outcome.log),
              **{k: getattr(outcome, k) for k in OUTCOME_FIELDS}}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / f"{outcome.role}.json", json.dumps(record, default=str))
    except (OSError, WriteFailed):
        pass  # only --resume reads it: without it that run is run again


def finished_run(out_dir: Path, role: Role, run_id: str) -> RunOutcome | None:
    """The run ``role`` of pilot ``run_id`` in ``out_dir`` as it ended (its record and its events); None when it has
    no record (it was still running when that pilot stopped), the record is another pilot's or not one, or the run's
    key was not kept (nothing could tell its own event lines from others: it is run again)."""
    from ..safefile import read_json

    base = out_dir.resolve() / "program"
    try:
        record = read_json(base / "runs" / f"{role}.json", 1 << 20, {"role": str, "log": str})
    except FileProblem:
        return None
    key = kept_key(out_dir, role)
    if record.get("role") != str(role) or record.get("run_id") != run_id or key is None:
        return None
    outcome = RunOutcome(role, None, 0.0, Path(record["log"]))
    for name in OUTCOME_FIELDS:
        if name in record and name != "event_problems":  # found again below, reading the same files
            setattr(outcome, name, record[name])
    outcome.events = read_rank_events(base / "events", role, outcome.event_problems, key)
    return outcome


@dataclass
class RunPlan:
    """What one run is asked to do."""

    role: Role
    save_at: tuple[int, ...] = ()
    stop_at: int | None = None
    resume_from: str | None = None
    kill_after_save: int | None = None  # SIGKILL the tree once rank 0 reports saved(this update)
    save_auto: tuple[int, int] | None = None  # (W, K): the program's own first save, asked for at W; stop K after
    stop_file: str | None = None  # should_stop is True once this file exists (a campaign's stop request)
    stop_rules: E.StopRules | None = None  # a campaign's stop rules, applied by the handle too
    timeout: float | None = None  # seconds before the run is killed (None: program.timeout; inf: never)
    threads: int | None = None  # CPU threads per process (a campaign run's share of the cores; program.env's wins)
    # The run's own secret: its handle signs every event line with it (a fresh one for every run).
    key: bytes = field(default_factory=lambda: secrets.token_bytes(E.KEY_BYTES), repr=False)


class EventTail:
    """The events appended to one event file since the last poll (whole lines only: the program may be mid-write),
    signed with the run's ``key`` by rank ``rank`` (:class:`EventCheck`; what was left out is in ``problems``)."""

    def __init__(self, path: Path, key: bytes, rank: int | None = None) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.lines = 0
        self.check = EventCheck(path, key, rank)
        self.problems = self.check.problems

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read(EVENTS_CAP)
        except OSError:
            return []
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            self.lines += 1
            event = self.check.take(line.decode("utf-8", errors="replace"), self.lines)
            if event is not None:
                out.append(event)
        return out


def _watch(tree: Tree, program: ProgramSpec, plan: RunPlan, rank0: Path, started: float,
           outcome: RunOutcome, on_poll: Callable[[], bool] | None = None) -> None:
    """Until the program ends; kill it past its timeout, once rank 0 reports the planned save, or when ``on_poll``
    (called every poll) says so."""
    timeout = program.timeout if plan.timeout is None else plan.timeout
    while tree.poll() is None:
        if time.monotonic() - started > timeout:
            outcome.timed_out = True
            return
        if on_poll is not None and on_poll():
            outcome.killed = True
            return
        if plan.kill_after_save is not None and any(
                e.get("kind") == Event.SAVED and e.get("update") == plan.kill_after_save
                for e in read_events(rank0, plan.key, rank=0)):
            outcome.killed = True
            return
        time.sleep(POLL_S)


def run_program(program: ProgramSpec, folder: Path, plan: RunPlan, out_dir: Path, run_id: str, ledger_path: Path,
                progress: Callable[[str], None] | None = None, on_poll: Callable[[], bool] | None = None) -> RunOutcome:
    """Run the program in ``plan.role`` until it ends, is killed after its save, times out, or ``on_poll`` (called
    every POLL_S while it runs) returns True."""
    base = out_dir.resolve() / "program"  # absolute: the program runs from the spec's folder
    events_dir, log = base / "events", base / f"{plan.role}.log"
    checkpoints = base / "checkpoints" / str(plan.role)
    checkpoints.mkdir(parents=True, exist_ok=True)
    events_dir.mkdir(parents=True, exist_ok=True)
    # This role's earlier events and record (a pilot run again into the same --out) are not this run's.
    for old in [*events_dir.glob(f"{plan.role}-rank*.jsonl"), *events_dir.glob(f"{plan.role}.first-save"),
                base / "runs" / f"{plan.role}.json"]:
        old.unlink(missing_ok=True)
    _keep_key(base, plan.role, plan.key)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k not in E.ALL} | (program.env or {})
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if plan.threads else ():  # torchrun keeps a value it is given
        if var not in (program.env or {}):
            env[var] = str(plan.threads)
    package_root = str(Path(__file__).resolve().parents[2])  # the program imports this pilotrun
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    env = with_torchrun_folder(env, base / "torchrun")
    env.update({E.PROGRAM: "1", E.ROLE: str(plan.role), E.RUN_ID: run_id, E.LEDGER: str(ledger_path.resolve()),
                E.EVENTS: str(events_dir), E.EVENTS_KEY: plan.key.hex(), E.CHECKPOINT_DIR: str(checkpoints),
                E.SAVE_AT: ",".join(map(str, plan.save_at)),
                E.STOP_AT: "" if plan.stop_at is None else str(plan.stop_at)})
    if plan.resume_from:
        env[E.RESUME_FROM] = plan.resume_from
    if plan.save_auto is not None:
        env[E.SAVE_AUTO] = ",".join(map(str, plan.save_auto))
    if plan.kill_after_save is not None:
        env[E.KILL_AT] = str(plan.kill_after_save)
    if plan.stop_file is not None:
        env[E.STOP_FILE] = plan.stop_file
    if plan.stop_rules is not None:
        env[E.STOP_RULES] = plan.stop_rules.to_json()
    started = time.monotonic()
    with open(log, "wb") as log_fh:
        # Under a keeper (pilotrun/procs.py): whatever the program starts (torchrun's ranks, its own children, a
        # daemon that double-forks) is killed when the run ends, however it ends, and with pilotrun if it dies.
        tree = Tree(command_words(program.words), env=env, label=f"program-{plan.role}", cwd=folder,
                    stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        outcome = RunOutcome(plan.role, None, 0.0, log)
        try:
            _watch(tree, program, plan, events_dir / f"{plan.role}-rank0.jsonl", started, outcome, on_poll)
        finally:
            ending = tree.kill()  # also after an exception or Ctrl-C here: leave nothing behind
            outcome.returncode = tree.returncode
            outcome.killed_pids, outcome.survivors = ending.killed, ending.survivors
            outcome.leftovers = ending.leftovers
    outcome.seconds = time.monotonic() - started
    outcome.events = read_rank_events(events_dir, plan.role, outcome.event_problems, plan.key)
    _record(base, outcome, run_id)
    if progress is not None:
        progress(f"{plan.role} run {outcome.how_it_ended()} after {outcome.seconds:.1f} s")
    return outcome
