"""``job = pilotrun.program()``: the handle a training program uses to be piloted by ``pilotrun run``.

Contract (stable: the transformers and Lightning integrations are built on it)::

    import pilotrun
    job = pilotrun.program()            # inert outside a pilot: the same script trains normally
    start = 0
    if job.resume_from:                 # a checkpoint path, or None
        start = load_my_checkpoint(job.resume_from)
    for update in range(start + 1, total + 1):
        with job.stage("first_step" if update == start + 1 else "steady_step", track=[model, opt]):
            loss = train_one_update()
        job.update(update, loss=loss, lr=sched.get_last_lr()[0], grad_norm=gn, ids=batch_ids)
        if job.should_save(update):
            path = save_my_checkpoint(job.checkpoint_dir or "ckpt", update)
            job.saved(update, path)
        if job.should_stop(update):
            break

``job.active: bool``
    True when started by ``pilotrun run`` (``$PILOTRUN_PROGRAM`` set). Inert (False): ``resume_from`` and
    ``checkpoint_dir`` are None, ``should_save``/``should_stop`` return False, ``update``/``saved``/
    ``record_gate`` do nothing and ``stage()`` yields a handle without measuring.
``job.role: Role`` (a str enum: "control" | "interrupted" | "resumed" | "stages" | "probe" | "campaign" | "describe";
    "" when inert)
``job.rank: int``, ``job.world_size: int``
    torchrun's ``RANK`` and ``WORLD_SIZE`` (0 and 1 without it).
``job.resume_from: str | None``
    The checkpoint to resume from (the resumed run only).
``job.checkpoint_dir: str | None``
    Where pilotrun wants this run's checkpoints written (a fresh folder per run).
``job.should_save(update) -> bool``, ``job.should_stop(update) -> bool``
    (In a campaign's run ``should_stop`` also applies the campaign's stop rules to the losses reported and its
    stop requests; with several ranks it is a collective then: call it on every rank at every update, as the
    callbacks do.)
    Update numbers count optimizer updates from 1 and continue across a resume (the first resumed update
    after a checkpoint of update N is N+1). Save where the program always saves *or* where ``should_save`` says
    (``pilot.resume.before: auto``, the default, proves the resume at the program's own first checkpoint and asks
    for none unless the program has made none by ``pilot.resume.auto_within``); report every save with ``saved``.
``job.update(update, loss=..., lr=..., grad_norm=None, ids=None, **extra)``
    One optimizer update, after ``optimizer.step()``. ``loss`` and ``lr`` are numbers or one-element tensors;
    ``ids`` the sample ids of the examples in the update (ints or strings; a list, tuple or integer tensor),
    on each rank its own; ``extra`` more numbers/strings compared like the rest. A refused value (a NaN or inf
    loss, an update number not above the last one, ids of the wrong type) becomes a ``problem`` the pilot
    reports as a row naming the update and field; it never raises.
``job.evaluated(update, loss, **metrics)``
    A validation point after update ``update``: its loss and any number metrics (``accuracy=...``). A campaign of
    the program judges its runs by the last one; the callbacks report the Trainer's ``eval_loss`` and Lightning's
    ``val_loss``.
``job.saved(update, path)``
    A checkpoint holding the state *after* update ``update`` is complete at ``path`` (call it on the rank that
    writes it, after the write; with per-rank files after a barrier). In the interrupted run this call does not
    return: pilotrun kills the whole process group with SIGKILL there. ``update`` is the update this rank reported
    last (``saved(N)`` follows ``update(N)``): a save numbered otherwise is said on stderr and the resume row warns,
    naming both numbers.
``with job.stage(name, inputs=None, track=()) as st:``
    :func:`pilotrun.stage`'s measurement (time, peaks kept apart, a ``fail`` row on an exception). Names the pilot
    reads: ``first_step``, ``steady_step``, ``eval``, ``save`` (also ``load``).
``job.describe(model, optimizer=None, batch=None, max_length=None, micro_batch_size=None, grad_accum_steps=None,
precision=None, activation_checkpointing=None, updates=None, max_grad_norm=None, compile=None)``
    The job's shape for ``pilotrun estimate|select|plan`` on the program spec: call it once the model and optimizer
    exist, before the first update (the transformers and Lightning callbacks call it for you). ``batch`` a collated
    micro batch (gives the micro batch size and length when they are not given); ``precision`` as
    ``train.precision`` names it (fp32, bf16, fp16, bf16-true, bf16-true-autocast); ``compile`` (model or blocks)
    when the program compiles after this call (a model already compiled, whole or per block, is seen). In the
    ``describe`` run the process ends here (exit 0, on every rank): the estimate needs no update.
``job.record_gate(gate, verdict, reason, **measurements)``
    An in-process gate's row (inspect, batch, accum_equivalence, overfit, export, reload_eval from an integration):
    ``verdict`` a :class:`~pilotrun.ledger.records.Verdict` or its text; measurements must be JSON values.

Where things go: every call appends one line to this role and rank's event file (``pilotrun.program.env``), signed
with the run's key (``$PILOTRUN_EVENTS_KEY``: a line the parent cannot verify is left out and named); the parent reads
them to compare the runs and writes the ledger rows of the pilot's run (one per gate and rank, from the recording
role: ``Role.records``), so a gate never gets a row per run.
"""
from __future__ import annotations

import atexit
import contextlib
import inspect
import json
import math
import os
import secrets
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from ..api import Session, StageHandle
from ..ledger.records import GateRow, Verdict
from . import env as E
from .env import Event, Role

# Seconds the interrupted run waits in saved() for the SIGKILL before it ends itself (the parent is gone).
DEFAULT_KILL_WAIT = 300.0


def _as_number(value: Any) -> float:
    """A float from a number or a one-element tensor; TypeError/ValueError otherwise."""
    if hasattr(value, "detach") and hasattr(value, "numel"):
        if value.numel() != 1:
            raise ValueError(f"a tensor of {value.numel()} elements, expected one")
        return float(value.detach().float().cpu().item()) if value.dtype.is_floating_point else float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{type(value).__name__}, expected a number")
    return float(value)


def _as_ids(ids: Any) -> list:
    """Sample ids as a JSON list of ints or strings; TypeError naming what was wrong otherwise."""
    if hasattr(ids, "tolist") and hasattr(ids, "dtype"):
        if getattr(ids.dtype, "is_floating_point", False):
            raise TypeError(f"a tensor of {ids.dtype}; ids must be integers or strings")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise TypeError(f"{type(ids).__name__}; give a list of ints or strings (one per example)")
    flat = []
    for item in ids:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise TypeError(f"an id of type {type(item).__name__} ({item!r}); ids must be ints or strings")
        flat.append(item)
    return flat


def _parse_updates(text: str | None) -> frozenset[int]:
    return frozenset(int(x) for x in (text or "").split(",") if x.strip())


class ProgramHandle:
    """See the module docstring. Build it with :func:`program` (or with an explicit ``environ`` in tests)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.active = env.get(E.PROGRAM, "") == "1"
        try:
            self.rank = int(env.get("RANK", "0") or 0)
            self.world_size = int(env.get("WORLD_SIZE", "1") or 1)
            self.role: Role | str = Role(env.get(E.ROLE, "")) if self.active else ""
            self._save_at = _parse_updates(env.get(E.SAVE_AT)) if self.active else frozenset()
            stop = env.get(E.STOP_AT) if self.active else None
            self._stop_at = int(stop) if stop else None
            self._kill_wait = float(env.get(E.KILL_WAIT) or DEFAULT_KILL_WAIT)
            kill_at = env.get(E.KILL_AT) if self.active else None
            self._kill_at = int(kill_at) if kill_at else None
            self._stop_file = (env.get(E.STOP_FILE) or None) if self.active else None
            rules = env.get(E.STOP_RULES) if self.active else None
            self._rules: E.StopRules | None = E.StopRules.from_json(rules) if rules else None
            auto = env.get(E.SAVE_AUTO) if self.active else None
            self._auto = tuple(int(x) for x in auto.split(",")) if auto else None
            key = env.get(E.EVENTS_KEY) if self.active else None
            # Without a key (a hand-set environment) the lines go unsigned: the parent leaves each out and says so.
            self._key = bytes.fromhex(key) if key else None
        except ValueError as exc:
            # Only a hand-set environment gets here (pilotrun sets these): say which variables, and how to train
            # without pilotrun.
            raise RuntimeError(f"pilotrun.program(): {exc}; ${E.ROLE} must be one of {', '.join(r.value for r in Role)}"
                               f", ${E.SAVE_AT} comma-separated integers, ${E.STOP_AT} an integer, ${E.SAVE_AUTO} two "
                               f"integers W,K, ${E.EVENTS_KEY} hex digits (pilotrun run sets "
                               f"them; unset ${E.PROGRAM} to train without pilotrun)") from None
        self.run_id = env.get(E.RUN_ID) if self.active else None
        self.resume_from = (env.get(E.RESUME_FROM) or None) if self.active else None
        self.checkpoint_dir = (env.get(E.CHECKPOINT_DIR) or None) if self.active else None
        self._events_dir = env.get(E.EVENTS) if self.active else None
        self._file: TextIO | None = None
        self._nonce = secrets.token_hex(4)  # with the pid, this handle's lines apart from a forked copy's
        self._seq = 0
        self._lock = threading.Lock()  # one line at a time, numbered in the order written
        self._last_update: int | None = None
        self._asked: set[int] = set()      # updates should_save said True for
        self._first_save: int | None = None
        self._misnumbered = False  # a save numbered unlike the update before it was said on stderr
        self._session: Session | None = None
        self._rule_broken = False   # a campaign's stop rule broken by a reported loss
        if self.active:
            self._emit(Event.START, pid=os.getpid(), world_size=self.world_size, resume_from=self.resume_from)
            atexit.register(self._at_exit)

    # -- what the pilot asks -------------------------------------------------------------------------------
    def should_save(self, update: int) -> bool:
        if not self.active:
            return False
        if self._auto is not None:  # only when the program has not saved on its own by update W
            ask = self.first_save() is None and update == self._auto[0]
        else:
            ask = update in self._save_at
        if ask:
            self._asked.add(update)
        return ask

    def should_stop(self, update: int) -> bool:
        if not self.active:
            return False
        if self._rules is not None or self._stop_file is not None:  # a campaign's run
            stop = self._campaign_stop()  # a collective with several ranks: every rank joins it, every update
            return stop or (self._stop_at is not None and update >= self._stop_at)
        if self._auto is not None:
            first = self.first_save()
            # Nothing saved even where pilotrun asked (W): stop K later anyway, as a fixed plan would have.
            return update >= (first if first is not None else self._auto[0]) + self._auto[1]
        return self._stop_at is not None and update >= self._stop_at

    # -- what the program reports --------------------------------------------------------------------------
    def update(self, update: int, loss: Any = None, lr: Any = None, grad_norm: Any = None, ids: Any = None,
               **extra: Any) -> None:
        if not self.active:
            return
        if isinstance(update, bool) or not isinstance(update, int):
            self._problem(None, "update", f"update number is {type(update).__name__} {update!r}; give an int")
            return
        if self._last_update is not None and update <= self._last_update:
            self._problem(update, "update", f"update {update} reported after update {self._last_update}; update "
                          "numbers must increase (count optimizer updates, not micro batches)")
            return
        if self.role == Role.DESCRIBE:
            self._problem(update, "describe", f"update {update} was reported before job.describe(...): describe the "
                          "job once the model and optimizer exist, before the first update (or use the transformers/"
                          "Lightning callback, which does)")
            self._end_describe_run()
        self._last_update = update
        record: dict[str, Any] = {"update": update}
        for name, value, required in (("loss", loss, True), ("lr", lr, True), ("grad_norm", grad_norm, False)):
            if value is None:
                if required:
                    self._problem(update, name, f"{name} not given; pass {name}=... to job.update()")
                record[name] = None
                continue
            try:
                number = _as_number(value)
            except (TypeError, ValueError) as exc:
                self._problem(update, name, f"{name} is {exc}")
                record[name] = None
                continue
            if not math.isfinite(number):
                self._problem(update, name, f"{name} is {number} (non-finite)", non_finite=True)
            record[name] = number if math.isfinite(number) else str(number)
        self._check_rules(record["loss"])
        record["ids"] = None
        if ids is not None:
            try:
                record["ids"] = _as_ids(ids)
            except TypeError as exc:
                self._problem(update, "ids", f"ids are {exc}")
        clean_extra: dict[str, Any] = {}
        for key, value in extra.items():
            if isinstance(value, str) or value is None:
                clean_extra[key] = value
                continue
            try:
                number = _as_number(value)
            except (TypeError, ValueError) as exc:
                self._problem(update, f"extra.{key}", f"{key} is {exc} (extra values are numbers or strings)")
                continue
            clean_extra[key] = number if math.isfinite(number) else str(number)
        record["extra"] = clean_extra
        self._emit(Event.UPDATE, **record)

    def evaluated(self, update: int, loss: Any, **metrics: Any) -> None:
        if not self.active:
            return
        try:
            value = _as_number(loss)
        except (TypeError, ValueError) as exc:
            self._problem(update, "evaluated", f"loss is {exc}")
            return
        clean = {}
        for key, metric in metrics.items():
            try:
                number = _as_number(metric)
            except (TypeError, ValueError):
                continue  # a text or nested metric the Trainer logs beside the loss: not a number to compare
            clean[key] = number if math.isfinite(number) else str(number)
        self._emit(Event.EVAL, update=update, loss=value if math.isfinite(value) else str(value), metrics=clean)

    def saved(self, update: int, path: str | os.PathLike) -> None:
        if not self.active:
            return
        where = Path(path).resolve()
        if not where.exists():
            self._problem(update, "saved", f"job.saved({update}, {str(path)!r}): nothing exists at {where}; call "
                          "it after the checkpoint is written")
            return
        self._check_numbering(update)
        self._emit(Event.SAVED, update=update, path=str(where), asked=update in self._asked)
        if self._first_save is None:
            self._first_save = update
            self._tell_ranks(update)
        if self.role == Role.INTERRUPTED and (update in self._save_at or update == self._kill_at):
            # The parent kills the whole process group with SIGKILL once it reads this line; waiting here makes the
            # kill land right after a complete save, whatever the program's speed.
            deadline = time.monotonic() + self._kill_wait
            while time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(3)

    def _check_numbering(self, update: int) -> None:
        """Say on stderr, once, a save numbered unlike the update reported last (the pilot's resume row names it
        too: the parent reads the same order of events). In the interrupted run the process is killed right after."""
        last = self._last_update
        if last is None or update == last or self._misnumbered:
            return
        self._misnumbered = True
        sys.stderr.write(f"pilotrun: job.saved({update}) after job.update({last}): saved(N) must follow update(N), "
                         "the checkpoint holding the state after the update it names\n")
        sys.stderr.flush()

    def describe(self, model: Any = None, optimizer: Any = None, *, facts: Any = None, **settings: Any) -> None:
        if not self.active:
            return
        from .describe import describe_objects

        try:
            if callable(facts):  # an integration's describer: whatever it raises becomes the reason, not a crash
                facts = facts()
            if facts is None:
                if model is None:
                    raise ValueError("give the model: job.describe(model, optimizer, batch=..., max_length=...)")
                try:  # the program's keywords checked apart: a wrong one is its mistake, not pilotrun's bug
                    inspect.signature(describe_objects).bind(model, optimizer, world_size=self.world_size, **settings)
                except TypeError as exc:
                    raise ValueError(f"{exc} (the keywords job.describe takes: batch, max_length, micro_batch_size, "
                                     "grad_accum_steps, precision, updates, ...)") from None
                facts = describe_objects(model, optimizer, world_size=self.world_size, **settings)
            data = facts.to_dict()
            _check_description(data)
        except Exception as exc:  # noqa: BLE001 - the program's objects: said as the description's problem
            from ..errors import is_internal

            # pilotrun's own bug (a programming error raised in its frame) is told apart, with its traceback: the
            # command then ends with exit 3, never blaming the program or a field the user did not write.
            internal = {"internal": True, "traceback": traceback.format_exc()[-6000:]} if is_internal(exc) else {}
            self._emit(Event.PROBLEM, update=None, field="describe", non_finite=False,
                       problem=f"job.describe(): {type(exc).__name__}: {exc}", **internal)
            data = None
        if data is not None:
            self._emit(Event.DESCRIBE, facts=data)
        if self.role == Role.DESCRIBE:
            self._end_describe_run()

    def _end_describe_run(self) -> None:
        """The describe run needs nothing after the description: end every rank here, cleanly and at once."""
        if self._file is not None:
            self._file.close()
            self._file = None
        os._exit(0)

    @contextlib.contextmanager
    def stage(self, name: str, inputs: dict | None = None, track: Iterable = (),
              device: Any = None) -> Iterator[StageHandle]:
        if not self.active:
            yield StageHandle(name)
            return
        if self._session is None:
            self._session = Session(f"program-{self.role}", rank=self.rank, world_size=self.world_size,
                                    run_id=self.run_id, sink=lambda row: self._emit(Event.STAGE, row=row))
        with self._session.stage(name, inputs={**(inputs or {}), "role": str(self.role)}, track=track,
                                 device=device) as st:
            yield st

    def record_gate(self, gate: str, verdict: Verdict | str, reason: str, **measurements: Any) -> None:
        if not self.active:
            return
        try:
            row = GateRow.now(str(gate), Verdict(verdict), str(reason), details=json.loads(json.dumps(measurements)),
                              rank=self.rank, world_size=self.world_size,
                              inputs={"rank": self.rank, "world_size": self.world_size, "role": str(self.role)})
        except (TypeError, ValueError) as exc:
            self._problem(None, f"record_gate({gate!r})", f"{type(exc).__name__}: {exc} (verdict is one of "
                          f"{', '.join(v.value for v in Verdict)}; measurements must be JSON values)")
            return
        self._emit(Event.GATE, row=row.to_dict())

    # -- a campaign's stop rules ----------------------------------------------------------------------------
    def _check_rules(self, loss: float | str | None) -> None:
        """The campaign's rules, applied to this rank's loss as pilotrun applies them to the run's series (a
        non-finite loss is recorded as its text)."""
        if self._rules is None or self._rule_broken or loss is None:
            return
        self._rule_broken = self._rules.broken(float(loss)) is not None

    def _campaign_stop(self) -> bool:
        """A stop rule broken here, or the stop file (budget, Ctrl-C); agreed over the ranks (any rank's reason stops
        them all at the same update: one rank stopping alone would leave the others in a collective)."""
        # The rules read rank 0's losses, as the run's series (and pilotrun's record of why it stopped) holds them.
        broken = self._rule_broken and self.rank == 0
        stop = broken or (self._stop_file is not None and os.path.exists(self._stop_file))
        if self.world_size > 1:
            stop = _any_rank(stop)
        return stop

    # -- the run's first save, the same on every rank -------------------------------------------------------
    # With pilot.resume.before: auto, should_save/should_stop depend on the run's first save, and most programs (and
    # both integrations) report saves on rank 0 only: a rank deciding alone would stop while the others train on
    # (a collective left waiting). The first rank to report one writes it beside the event files; the others read it.
    # Ranks are in step (each update's gradients are all-reduced), so it is there before any rank asks about a later
    # update.
    def _first_save_file(self) -> Path | None:
        return None if self._events_dir is None else Path(self._events_dir) / f"{self.role}.first-save"

    def _tell_ranks(self, update: int) -> None:
        path = self._first_save_file()
        if path is None or self._auto is None:
            return
        with contextlib.suppress(FileExistsError, OSError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as fh:
                fh.write(str(update))

    def first_save(self) -> int | None:
        """The update after which this run first saved, on whichever rank reported it (None: not yet)."""
        if self._first_save is None and (path := self._first_save_file()) is not None:
            with contextlib.suppress(OSError, ValueError):
                self._first_save = int(path.read_text())
        return self._first_save

    # -- the event file ------------------------------------------------------------------------------------
    @property
    def events_path(self) -> Path | None:
        return None if self._events_dir is None else Path(self._events_dir) / f"{self.role}-rank{self.rank}.jsonl"

    def _problem(self, update: int | None, field: str, problem: str, non_finite: bool = False) -> None:
        self._emit(Event.PROBLEM, update=update, field=field, problem=problem, non_finite=non_finite)

    def _emit(self, kind: Event, **fields: Any) -> None:
        path = self.events_path
        if path is None:
            return
        with self._lock:
            if self._file is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(path, "a", encoding="utf-8")
            body = json.dumps({"kind": str(kind), "t": time.time(), "rank": self.rank,
                               "writer": f"{self._nonce}-{os.getpid()}", "seq": self._seq, **fields}, default=str)
            self._seq += 1
            # One line per event, flushed: the parent reads it while this process runs (and SIGKILLs it after SAVED).
            self._file.write((E.sign(self._key, body) if self._key is not None else body) + "\n")
            self._file.flush()

    def _at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self._emit(Event.END)
            if self._file is not None:
                self._file.close()
                self._file = None
        # A gloo group left initialised, or destroyed but still held by torch, would be freed during interpreter
        # shutdown and abort the finished process (pilotrun.distributed.close_at_exit); close it while Python lives.
        if "torch.distributed" in sys.modules:
            with contextlib.suppress(Exception):
                from ..distributed import close_at_exit

                close_at_exit()


def _any_rank(flag: bool) -> bool:
    """Whether any rank's flag is set (an all-reduce, when the program's process group is up)."""
    import torch
    import torch.distributed as dist

    from .. import backends

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    # The collective's tensor lives where the group's backend reads it: the current accelerator for NCCL/RCCL.
    device = next((rt.current_device() for rt in (backends.get(n) for n in backends.names())
                   if rt.dist_backend == dist.get_backend() and rt.indexed), None) or torch.device("cpu")
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _check_description(data: dict) -> None:
    """ValueError naming the keyword whose value the estimate could not use."""
    from ..config.sections import PRECISIONS  # here: a program imports the handle before it has a spec to read

    if data.get("precision") not in (None, *PRECISIONS):
        raise ValueError(f"precision={data['precision']!r}; give one of {', '.join(PRECISIONS)} (as train.precision "
                         "names them)")
    for key in ("micro_batch_size", "grad_accum_steps", "max_length", "updates"):
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{key}={value!r}; give a positive int")


_handle: ProgramHandle | None = None


def program() -> ProgramHandle:
    """The process's handle (one per process: repeated calls return the same one)."""
    global _handle
    if _handle is None:
        _handle = ProgramHandle()
    return _handle
