"""What the ledger stores, as types: verdicts, run kinds and statuses, why a run stopped, and the gate row.

Modules hand each other these enums and the :class:`GateRow` dataclass, never sentences: a row's
``reason`` is for people, its ``verdict`` and ``failure`` are for code. Every status a run can
have is declared here with what it means; the SQLite schema (:mod:`pilotrun.ledger.store`) keeps
their values as text, so the ledger reads the same from SQL, CSV or Python.

Example::

    row = GateRow.now(GateName.LOAD, Verdict.PASS, "LlamaForCausalLM: 125.2K parameters")
    Verdict.worst(["pass", "warn"])      # Verdict.WARN
    RunStatus.of_pilot([row.to_dict()])  # RunStatus.PASS
"""
from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Any


class TextEnum(str, Enum):
    """A string enum that prints, formats, serialises and compares as its value (Python 3.10 has no StrEnum)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __hash__(self) -> int:  # Enum hashes the member's name; a dict keyed by members must find its text too
        return hash(str(self.value))


def now() -> str:
    """A UTC timestamp as every row stores it."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def new_run_id(name: str) -> str:
    """``<name>-<UTC time>-<8 hex>``: sortable by time, unique across machines writing one ledger. 32 random bits:
    with 16, the spec fuzz test's few hundred runs of one spec in a minute into one ledger shared an id in one full
    test run of four, and the second run's start failed on the ledger's unique key."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{secrets.token_hex(4)}"


class GateName(TextEnum):
    """Every gate, in the order the pilot runs them (``gates.registry.GATES`` declares the same, in this order: its
    ``problems()`` checks). Each gate class's ``name`` is its member; code that reads rows compares with these."""

    LOCK = "lock"                            # revisions, versions, config and seeds recorded; drift reported
    INSPECT = "inspect"                      # examples shown as the loss sees them; counts over the train split
    SPLIT = "split"                          # no leakage unit shared between train and val
    BATCH = "batch"                          # examples-per-update arithmetic
    LOAD = "load"                            # tokenizer, data and model built, on the device, wrapped
    FIRST_STEP = "first_step"                # the first update (allocates the optimizer state)
    STEADY_STEP = "steady_step"              # later updates: the training peak and the time per update
    ACCUM_EQUIVALENCE = "accum_equivalence"  # accumulation gives the gradient of the whole batch
    EVAL = "eval"                            # the longest evaluation batch, then the metric
    SAVE = "save"                            # the full training state written atomically
    EXPORT = "export"                        # the inference artifact
    RESTORE = "restore"                      # a fresh process restores exactly what was saved
    RESUME = "resume"                        # killed after a save and resumed, the updates continue the same
    OVERFIT = "overfit"                      # a tiny subset is learned
    RELOAD_EVAL = "reload_eval"              # the export reloaded in a fresh process gives the same outputs


# The stages that train (a backward and an optimizer step): the estimator models their gradients and optimizer state.
TRAINING_GATES = (GateName.FIRST_STEP, GateName.STEADY_STEP)


class Verdict(TextEnum):
    """A gate's answer. ``fail`` stops the gates that need what it would have produced."""

    PASS = "pass"  # the stage did what the long run needs
    WARN = "warn"  # it ran, and something deserves a look before renting (the reason says what)
    FAIL = "fail"  # it did not: the reason names the stage, the input and the usual cause
    SKIP = "skip"  # it did not run: a gate it needs failed, or the driver cannot do it (the reason says which)

    @property
    def severity(self) -> int:
        """Lower is worse: fail < skip < warn < pass."""
        return _SEVERITY[self]

    @staticmethod
    def worst(verdicts: Iterable[str]) -> Verdict:
        """The worst of several (every rank's row of one gate, say); ``pass`` for none."""
        found = [Verdict(v) for v in verdicts]
        return min(found, key=lambda v: v.severity) if found else Verdict.PASS

    @property
    def blocks(self) -> bool:
        """Gates that need this gate's products cannot run after it."""
        return self in (Verdict.FAIL, Verdict.SKIP)


_SEVERITY = {Verdict.FAIL: 0, Verdict.SKIP: 1, Verdict.WARN: 2, Verdict.PASS: 3}


class Failure(TextEnum):
    """What kind of failure a ``fail`` row is, for code that reacts to it (the advisor after an OOM)."""

    OUT_OF_MEMORY = "out-of-memory"    # the device (or host) ran out of memory in this stage
    NON_FINITE = "non-finite"          # a loss, gradient norm or parameter became inf/NaN
    CHECK = "check"                    # a check of the gate found a defect (its reason says which)
    ERROR = "error"                    # the stage raised (user code or the environment); a traceback is kept


class RunKind(TextEnum):
    PILOT = "pilot"                # `pilotrun run` / `launch`: the gates of one spec
    STAGE = "stage"                # `pilotrun.stage()` in a user's own loop
    CAMPAIGN = "campaign"          # a declared set of runs varying one key
    CAMPAIGN_RUN = "campaign-run"  # one run of a campaign (variant x seed)
    VARIANTS = "variants"          # `pilotrun variants`: the control and memory fixes run side by side, measured


# The row ``pilotrun variants`` writes per configuration (the control's first, each variant's linked to it by
# VariantDetails.control_row): not a gate, so not a GateName.
VARIANT_ROW = "variant"


class RunStatus(TextEnum):
    """Every status a run row can hold. A pilot or stage run ends as the worst of its rows."""

    # While it runs (any kind). A row left "running" with no end time was killed without recording it.
    RUNNING = "running"
    # Pilot and stage runs.
    PASS = "pass"                  # no gate failed or warned
    WARN = "warn"                  # no gate failed; some warned
    FAIL = "fail"                  # at least one gate failed
    ERROR = "error"                # pilotrun itself stopped with an error; the rows written so far are kept
    INTERRUPTED = "interrupted"    # Ctrl-C / SIGTERM (pilots, campaigns); `--resume` continues it
    # Campaign runs.
    PLANNED = "planned"            # declared, not started yet
    FINISHED = "finished"          # ran its declared updates; only such a run has a final validation point
    DIVERGED = "diverged"          # stopped by a declared rule: non-finite loss or the divergence threshold
    FAILED = "failed"              # its process raised or ended without a result
    STOPPED = "stopped"            # cut short (interrupt, budget, the campaign killed) at a recorded update
    NOT_RUN = "not-run"            # never started (interrupt or budget before it)
    REFUSED = "refused"            # not started: the lock drifted from the campaign's (see --allow-drift)
    # Campaigns.
    FINISHED_WITH_STOPS = "finished-with-stops"  # every run has an end, and not all of them finished

    @staticmethod
    def of_pilot(rows: Iterable[Mapping[str, Any]]) -> RunStatus:
        """A pilot's status from its gate rows in their JSON form (see :meth:`of_verdicts`)."""
        return RunStatus.of_verdicts(r["verdict"] for r in rows)

    @staticmethod
    def of_verdicts(found: Iterable[Verdict | str]) -> RunStatus:
        """A pilot's status from its rows' verdicts: fail if any failed, warn if any warned, else pass."""
        verdicts = {Verdict(v) for v in found}
        if Verdict.FAIL in verdicts:
            return RunStatus.FAIL
        return RunStatus.WARN if Verdict.WARN in verdicts else RunStatus.PASS


# A pilot row in one of these may be continued with `pilotrun run --resume`.
RESUMABLE = (RunStatus.RUNNING, RunStatus.INTERRUPTED, RunStatus.ERROR)
# A campaign run whose end is a result (retrying it is a deliberate choice); the others were cut short.
RESULTS = (RunStatus.FINISHED, RunStatus.DIVERGED, RunStatus.FAILED, RunStatus.REFUSED)
CUT_SHORT = (RunStatus.NOT_RUN, RunStatus.STOPPED)


class StopKind(TextEnum):
    """Why a campaign run ended before its declared updates (``stop_reason`` says it in words)."""

    INTERRUPTED = "interrupted"        # Ctrl-C, SIGTERM or SIGHUP, at an update boundary
    BUDGET = "budget"                  # the campaign's time budget ran out
    NON_FINITE = "non-finite"          # a non-finite loss or gradient norm (declared stop rule)
    DIVERGENCE = "divergence"          # the loss rose past the declared multiple of the first loss
    ERROR = "error"                    # the run raised
    LOCK_DRIFT = "lock-drift"          # refused: the environment drifted from the campaign's lock
    PROCESS_LOST = "process-lost"      # its process ended without recording where
    CAMPAIGN_KILLED = "campaign-killed"  # the campaign's own process was killed (found by --resume)
    WORKER_LOST = "worker-lost"        # the Ray worker or node running it went away (campaign --engine ray)


@dataclass(frozen=True)
class RunEnd:
    """How a campaign run ended: the status, and for anything but ``finished`` the kind, the words and the update."""

    status: RunStatus
    stop: StopKind | None = None
    reason: str | None = None
    at: int | None = None  # the last update it recorded (0: none)

    def fields(self) -> dict:
        """The meta fields the ledger keeps (stop_kind, stop_reason, stopped_at)."""
        return {"stop_kind": None if self.stop is None else str(self.stop), "stop_reason": self.reason,
                "stopped_at": self.at}


class Kept(TextEnum):
    """What a campaign run keeps on disk whose manifest sha256 the ledger records (its meta's ``manifests``): the
    campaign's counterpart of a pilot's export and save rows, so the loading policy knows exactly these folders."""

    EXPORT = "export"          # <run>/export
    CHECKPOINT = "checkpoint"  # <run>/checkpoints/final


MANIFESTS = "manifests"  # the meta field: {Kept: manifest sha256}


def kept_manifests(meta: Mapping[str, Any] | None) -> dict[Kept, str]:
    """The manifest sha256s a campaign run's meta records, by what was kept (entries of another shape ignored)."""
    found = (meta or {}).get(MANIFESTS) if isinstance(meta, Mapping) else None
    if not isinstance(found, Mapping):
        return {}
    names = {m.value for m in Kept}
    return {Kept(k): v for k, v in found.items() if k in names and isinstance(v, str) and len(v) == 64}


def final_val_loss(status: str, meta: Mapping[str, Any]) -> float | None:
    """A run's final validation loss: only a finished run has one (a stopped run's last point is not it)."""
    return (meta.get("final") or {}).get("val_loss") if status == RunStatus.FINISHED else None


class Series(TextEnum):
    """The per-update metric series of a campaign run (pilots' metrics belong to the gate that measured them)."""

    TRAIN = "train"  # one point per optimizer update: loss, lr, grad norm, sample ids
    VAL = "val"      # one point per validation: loss, accuracy


ROW_FIELDS = ("gate", "verdict", "reason", "inputs", "memory", "seconds", "rank", "world_size", "started_at",
              "ended_at", "details")


@dataclass
class GateRow:
    """One gate's row, as the ledger and ``report.json`` keep it. Every row is built through this class."""

    gate: str
    verdict: Verdict
    reason: str
    inputs: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    seconds: float | None = None
    started_at: str = field(default_factory=now)
    ended_at: str = field(default_factory=now)
    details: dict = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    failure: Failure | None = None  # for fail rows: which kind (kept in details["failure"])

    def __post_init__(self) -> None:
        self.verdict = Verdict(self.verdict)  # an unknown verdict is a bug: refuse it here, not in SQL
        if self.failure is None and self.details.get("failure"):
            self.failure = Failure(self.details["failure"])

    @classmethod
    def now(cls, gate: str, verdict: Verdict | str, reason: str, **fields: Any) -> GateRow:
        t = now()
        return cls(gate, Verdict(verdict), reason, started_at=t, ended_at=t, **fields)

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any]) -> GateRow:
        known = {k: row[k] for k in ROW_FIELDS if k in row and row[k] is not None}
        known.setdefault("reason", "")
        return cls(**known)

    def to_dict(self) -> dict:
        """JSON types only, in the shape of ``report.json``'s ``gates`` entries."""
        details = dict(self.details)
        if self.failure is not None:
            details["failure"] = str(self.failure)
        out = {"gate": self.gate, "verdict": str(self.verdict), "reason": self.reason or str(self.verdict),
               "inputs": self.inputs, "memory": self.memory, "seconds": self.seconds, "rank": self.rank,
               "world_size": self.world_size, "started_at": self.started_at, "ended_at": self.ended_at,
               "details": details}
        return as_json(out)


def as_json(obj: Any) -> Any:
    """Rows hold JSON types only: mappings, lists, strings, numbers, booleans and null (anything else as text)."""
    if isinstance(obj, Mapping):
        return {str(k): as_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_json(v) for v in obj]
    if isinstance(obj, Enum):
        return str(obj.value)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


__all__ = ["CUT_SHORT", "RESULTS", "RESUMABLE", "Failure", "GateName", "GateRow", "RunEnd", "RunKind", "RunStatus",
           "Series", "StopKind", "TextEnum", "Verdict", "as_json", "final_val_loss", "new_run_id", "now", "Kept",
           "MANIFESTS", "kept_manifests", "VARIANT_ROW"]
