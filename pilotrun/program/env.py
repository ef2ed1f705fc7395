"""How ``pilotrun run`` talks to the program it pilots: environment variables, the only channel in (this module
is the one place they are named), and per-rank event files, the only channel out.

Set by the parent for every process it starts (torchrun passes them to each rank):

============================  ==========================================================================
``PILOTRUN_PROGRAM``          ``1``: the handle is active (unset: ``pilotrun.program()`` is inert)
``PILOTRUN_ROLE``             which of the pilot's runs this is (:class:`Role`)
``PILOTRUN_RUN_ID``           the pilot's run id in the ledger
``PILOTRUN_LEDGER``           the ledger file (also read by ``pilotrun.stage()`` outside a pilot)
``PILOTRUN_EVENTS``           folder for the event files: ``<role>-rank<rank>.jsonl``
``PILOTRUN_EVENTS_KEY``       this run's secret key (hex, a fresh one per run): the handle signs every event line
``PILOTRUN_CHECKPOINT_DIR``   where pilotrun wants this run's checkpoints written (a fresh folder per run)
``PILOTRUN_RESUME_FROM``      the checkpoint to resume from (the resumed run only)
``PILOTRUN_SAVE_AT``          comma-separated updates after which to save (``should_save``)
``PILOTRUN_STOP_AT``          the update after which to stop (``should_stop``)
``PILOTRUN_KILL_WAIT``        seconds the interrupted run waits in ``saved()`` for its SIGKILL (default 300)
``PILOTRUN_KILL_AT``          the update whose ``saved()`` the interrupted run waits in for its SIGKILL
``PILOTRUN_SAVE_AUTO``        ``W,K`` (``pilot.resume.before: auto``): no save is asked for unless the program has
                              made none of its own by update W; the run stops K updates after its first save
``PILOTRUN_STOP_FILE``        a campaign run's stop request: ``should_stop`` is True once this file exists (a stop
                              rule, the budget, Ctrl-C)
``PILOTRUN_STOP_RULES``       a campaign's stop rules as JSON (``non_finite``, ``divergence``): ``should_stop`` is True
                              from the update whose loss breaks one, as pilotrun records it
============================  ==========================================================================

Rank and world size come from torchrun's own ``RANK`` and ``WORLD_SIZE`` (0 and 1 without torchrun).

Every event line is bound to the run that asked for it: the handle ends it with ``"mac"``, the HMAC-SHA256 under
``PILOTRUN_EVENTS_KEY`` of the line's text before that field (:func:`sign`), and numbers it (``writer``: the handle
and its process; ``seq``: from 0 per writer). The parent keeps only lines whose MAC is right (:func:`signed_body`), so
a line appended by anything that does not hold the key (another process writing into the run's folder) becomes no
row; it names each line it left out, a repeated one and a gap in a writer's numbers.

An update's ``ids`` are the examples' own ids unless its ``extra`` says otherwise under :data:`IDS_ARE` (an
:class:`IdKind`): the Trainer and Lightning integrations report the examples' positions in the training dataset where
the items carry no ``id``, and the resume row then says it compared dataset positions.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..ledger.records import StopKind, TextEnum

PROGRAM = "PILOTRUN_PROGRAM"
ROLE = "PILOTRUN_ROLE"
RUN_ID = "PILOTRUN_RUN_ID"
LEDGER = "PILOTRUN_LEDGER"
EVENTS = "PILOTRUN_EVENTS"
EVENTS_KEY = "PILOTRUN_EVENTS_KEY"
CHECKPOINT_DIR = "PILOTRUN_CHECKPOINT_DIR"
RESUME_FROM = "PILOTRUN_RESUME_FROM"
SAVE_AT = "PILOTRUN_SAVE_AT"
STOP_AT = "PILOTRUN_STOP_AT"
KILL_WAIT = "PILOTRUN_KILL_WAIT"
SAVE_AUTO = "PILOTRUN_SAVE_AUTO"
KILL_AT = "PILOTRUN_KILL_AT"
STOP_FILE = "PILOTRUN_STOP_FILE"
STOP_RULES = "PILOTRUN_STOP_RULES"

ALL = (PROGRAM, ROLE, RUN_ID, LEDGER, EVENTS, EVENTS_KEY, CHECKPOINT_DIR, RESUME_FROM, SAVE_AT, STOP_AT, KILL_WAIT,
       SAVE_AUTO, KILL_AT, STOP_FILE, STOP_RULES)


KEY_BYTES = 32
MAC = "mac"
# The MAC is the line's last field, as :func:`sign` writes it (json.dumps' own separators).
_MAC_TAIL = re.compile(r', "mac": "([0-9a-f]{64})"\}$')


def sign(key: bytes, body: str) -> str:
    """One event line: ``body`` (a JSON object's text, without a ``mac`` field) with the HMAC-SHA256 of its bytes
    under ``key`` added as its last field."""
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    return f'{body[:-1]}, "{MAC}": "{mac}"}}'


def signed_body(key: bytes, line: str) -> str | None:
    """The text :func:`sign` signed in ``line`` (a JSON object), when its MAC is right under ``key``; None when the
    line carries none or a wrong one."""
    tail = _MAC_TAIL.search(line)
    if tail is None:
        return None
    body = line[:tail.start()] + "}"
    want = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    return body if hmac.compare_digest(want, tail.group(1)) else None


# The update field (in ``extra``) naming what its ids are, when they are not the items' own (an IdKind value).
IDS_ARE = "ids_are"


class IdKind(TextEnum):
    """What an update's ``ids`` are."""

    ITEM = "item-id"                      # each example's own id (job.update(ids=...) without IDS_ARE)
    POSITION = "dataset-position"         # the examples' indices in the training dataset, as its sampler yielded them
    MIXED = "item-id-or-dataset-position"  # the own id where a micro batch's items carry one, the position elsewhere

    @property
    def label(self) -> str:
        """How a row names them."""
        return {IdKind.ITEM: "ids", IdKind.POSITION: "dataset positions",
                IdKind.MIXED: "ids and dataset positions"}[self]

    @classmethod
    def of(cls, record: UpdateRecord) -> IdKind:
        """The kind of one update record's ids (the items' own when the record does not say)."""
        value = record.extra.get(IDS_ARE)
        try:
            return cls(value) if value is not None else cls.ITEM
        except ValueError:
            return cls.ITEM


@dataclass
class UpdateRecord:
    """One optimizer update as a run reported it: what a resume is judged by and a campaign run's train series
    keeps. A program's handle sends it as a ``job.update`` event (:meth:`from_json`); pilotrun's loop worker writes
    its own record, floats as hex for bitwise comparison (``program.compare.loop_updates``). A non-finite number
    arrives as its text ("nan", "inf"), as the handle sends it."""

    update: int
    ids: list | None = None   # the examples' ids (or dataset positions: ``extra[IDS_ARE]``), None when not reported
    loss: Any = None
    lr: Any = None
    grad_norm: Any = None
    extra: dict = field(default_factory=dict)  # the program's own numbers and strings, compared too

    @classmethod
    def from_json(cls, e: dict) -> UpdateRecord:
        extra = e.get("extra")
        return cls(int(e["update"]), e.get("ids"), e.get("loss"), e.get("lr"), e.get("grad_norm"),
                   dict(extra) if isinstance(extra, dict) else {})

    def to_json(self) -> dict:
        return {"update": self.update, "ids": self.ids, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
                "extra": dict(self.extra)}

    def value(self, name: str) -> Any:
        """One of ``program.compare.FIELDS`` by name."""
        return getattr(self, name)


class Role(TextEnum):
    """Which of the pilot's runs a process belongs to."""

    CONTROL = "control"          # uninterrupted to N+K updates, saving after N like the interrupted run; its
    #                              stages become first_step/steady_step/eval/save and its gate rows are recorded
    INTERRUPTED = "interrupted"  # saves after N, then is SIGKILLed (the whole process group) once it reports it
    RESUMED = "resumed"          # a fresh process resumed from that checkpoint to N+K
    STAGES = "stages"            # stages only, no resume (``--gates`` without resume)
    PROBE = "probe"              # a short run for in-process gates (integrations)
    CAMPAIGN = "campaign"        # one run of a campaign: its updates and validations become the run's series, and
    #                              it stops where pilotrun's stop rules say (PILOTRUN_STOP_FILE)
    DESCRIBE = "describe"        # stops where the program describes its job (job.describe), before its first update:
    #                              what estimate, select and plan trace

    @property
    def records(self) -> bool:
        """Whether this role's stages and gate rows become the pilot's rows (one run records; the others
        stream theirs to their event file only, so a gate never gets three rows per rank)."""
        return self in (Role.CONTROL, Role.STAGES, Role.PROBE)


class Event(TextEnum):
    """The ``kind`` of one line of an event file."""

    START = "start"      # the handle came up: rank, world size, pid, role
    UPDATE = "update"    # one optimizer update: update, loss, lr, grad_norm, ids, extra
    SAVED = "saved"      # a checkpoint written after ``update`` at ``path``; ``asked``: should_save was True there
    STAGE = "stage"      # a stage's row (pilotrun.api's measurement)
    GATE = "gate"        # an in-process gate's row (record_gate)
    PROBLEM = "problem"  # a value the program reported that was refused: field, problem, update
    EVAL = "eval"        # a validation point: update, loss, metrics (job.evaluated)
    DESCRIBE = "describe"  # the job's shape (program.describe.JobFacts as a dict under ``facts``)
    END = "end"          # the process exited normally (atexit)


@dataclass
class StopRules:
    """A campaign's stop rules, as ``PILOTRUN_STOP_RULES`` carries them, applied to a run's losses in order: the same
    object decides in the program's handle (``should_stop``) and in the run that records why it stopped.
    ``first_loss``: the run's first finite loss (set by the first one seen, or carried over to a continued run)."""

    non_finite: bool = True
    divergence: float | None = None
    first_loss: float | None = None

    def broken(self, loss: float) -> StopKind | None:
        """The rule ``loss`` breaks, if any (a non-finite loss is never a run's first loss)."""
        if not math.isfinite(loss):
            return StopKind.NON_FINITE if self.non_finite else None
        if self.first_loss is None:
            self.first_loss = loss
        if self.divergence and loss > self.divergence * self.first_loss:
            return StopKind.DIVERGENCE
        return None

    @classmethod
    def declared(cls, stop: dict, first_loss: Any = None) -> StopRules:
        """The rules a campaign's run plan declares (its ``stop`` mapping: campaign.spec.StopSpec as JSON), with the
        first loss a continued run carries over."""
        first = float(first_loss) if isinstance(first_loss, (int, float)) else None
        return cls(bool(stop.get("non_finite", True)), stop.get("divergence"), first)

    def why(self, kind: StopKind, loss: Any) -> str:
        """The run's end in words, for the rule ``kind`` that ``loss`` broke."""
        if kind is StopKind.NON_FINITE:
            return f"non-finite loss ({loss})"
        return f"loss {float(loss):.4g} > {self.divergence:g} x the first loss {self.first_loss:.4g}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StopRules:
        """ValueError naming what is wrong (only a hand-set environment gets one)."""
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) - {"non_finite", "divergence", "first_loss"}:
            raise ValueError(f"{STOP_RULES} must be a JSON object of non_finite, divergence, first_loss")
        return cls(**data)
