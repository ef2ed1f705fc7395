"""What a gate is, what it returns, and how a failure becomes a reason a person can act on."""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..measure.meter import StageMeter, is_oom, oom_detail
from ..train.loop import TrainingCheckError

if TYPE_CHECKING:
    from .context import PilotContext

VERDICTS = ("pass", "warn", "fail", "skip")


@dataclass
class Outcome:
    """What a gate's ``run`` returns; the runner adds memory, seconds and timestamps."""

    verdict: str = "pass"
    reason: str = ""
    inputs: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)
    # Set when the measured work ran in a child process: its counters replace this process's.
    memory: dict | None = None

    def warn(self, reason: str) -> None:
        if self.verdict == "pass":
            self.verdict = "warn"
            self.reason = reason
        elif self.verdict == "warn":
            self.reason = f"{self.reason}; {reason}"


class GateFailure(Exception):
    """Raised inside a gate to fail it with a prepared reason (and any inputs/details gathered)."""

    def __init__(self, reason: str, inputs: dict | None = None, details: dict | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.inputs = inputs or {}
        self.details = details or {}


class Gate:
    """One stage of the pilot. Subclasses set ``name``, ``depends_on`` and implement :meth:`run`."""

    name: ClassVar[str]
    depends_on: ClassVar[tuple[str, ...]] = ()
    # "stage": the CPU tensor tracker runs for the whole gate; "manual": the gate
    # chooses the tracked block (so timed updates run without tracking overhead).
    tensor_tracking: ClassVar[str] = "stage"
    # Whether a failure reason starts with the shape ("eval at length 4096, batch 8"): only
    # where the shape is what the gate is about.
    shape_in_reason: ClassVar[bool] = False
    # Gates that read the datasets: skipped once building the data has failed in an earlier gate.
    needs_data: ClassVar[bool] = False
    progress_total: ClassVar[int | None] = None

    def track(self, ctx: "PilotContext") -> list:
        """Objects whose tensors are live before the gate starts (model, optimizer)."""
        return ctx.tracked()

    def run(self, ctx: "PilotContext", meter: StageMeter) -> Outcome:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe_inputs(self, ctx: "PilotContext") -> dict:
        return ctx.base_inputs()

    def failure_inputs(self, ctx: "PilotContext") -> dict:
        """Inputs for a failure row: what the gate had reached when it failed (set ``self.live_inputs``)."""
        live = getattr(self, "live_inputs", None)
        return dict(live) if live else self.describe_inputs(ctx)


def _user_frame(tb) -> str:
    """The innermost frame outside pilotrun, torch and transformers: usually the user's bug."""
    frames = traceback.extract_tb(tb)
    skip = ("/pilotrun/", "/torch/", "/transformers/", "/site-packages/", "<frozen")
    for fr in reversed(frames):
        if not any(s in fr.filename for s in skip):
            return f" (at {Path(fr.filename).name}:{fr.lineno} in {fr.name})"
    return ""


def failure_reason(gate: "Gate", exc: BaseException, ctx: "PilotContext", inputs: dict) -> str:
    """A one-line reason naming the stage and the input that caused the failure."""
    if isinstance(exc, GateFailure):
        return exc.reason
    prefix = f"{gate.name} at {ctx.shape_phrase(gate.name, inputs)}: " if gate.shape_in_reason else ""
    if is_oom(exc):
        return f"{gate.name} at {ctx.shape_phrase(gate.name, inputs)}: {oom_detail(ctx.device)}"
    if isinstance(exc, TrainingCheckError):
        return f"{prefix}{exc}"
    if isinstance(exc, SystemExit):
        return f"{prefix}the code called sys.exit({exc.code!r}){_user_frame(exc.__traceback__)}; raise an exception instead"
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(message) > 300:
        message = message[:297] + "..."
    hint = next((h for k, h in HINTS if k in message), "")
    return f"{prefix}{type(exc).__name__}: {message}{_user_frame(exc.__traceback__)}{hint}"


HINTS = [
    ("does not require grad", " — the loss is detached from the parameters (computed under no_grad, with .detach() or via .item()?)"),
    ("unexpected keyword argument", " — forward(**batch) receives every key the collate returns"),
    ("Target", " — a class index outside the model's output size?"),
]


def as_dict(obj: Any) -> Any:
    """Rows hold JSON types only."""
    if isinstance(obj, dict):
        return {str(k): as_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_dict(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def on_main_rank(ctx: "PilotContext", gate: "Gate", work) -> Outcome:
    """Run ``work()`` on rank 0 only and give every rank its outcome (the others wait at the broadcast).

    For gates whose real work happens in fresh processes or on one full copy (restore, resume,
    reload_eval, export): rank 0 must never raise before the broadcast, or the others would wait forever.
    """
    from .. import distributed

    env = ctx.env
    if env is None or not env.active:
        return work()
    outcome: Outcome | None = None
    if env.is_main:
        try:
            outcome = work()
        except (Exception, SystemExit) as exc:
            inputs = gate.failure_inputs(ctx)
            outcome = Outcome("fail", failure_reason(gate, exc, ctx, inputs), inputs,
                              dict(getattr(exc, "details", {}) or {}))
    shared = distributed.broadcast(env, None if outcome is None else
                                   (outcome.verdict, outcome.reason, outcome.inputs, outcome.details, outcome.memory))
    if env.is_main:
        return outcome
    verdict, reason, inputs, details, memory = shared
    mine = Outcome(verdict, f"rank 0 ran it for all ranks: {reason}", {**inputs, "rank": ctx.rank},
                   {"from_rank": 0})
    if verdict == "fail":
        raise GateFailure(mine.reason, inputs=mine.inputs)
    return mine
