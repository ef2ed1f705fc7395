"""What a gate is: a stage of the job that declares what it needs and produces, and returns an outcome.

A gate class declares, in one place:

* ``needs`` — products that must exist before it runs; the gates producing them are its
  dependencies (a failed or skipped producer skips it, naming the root cause);
* ``uses`` — products it reads when present, without depending on them;
* ``produces`` — what it leaves in the context for later gates;
* ``requires`` — the driver capabilities it needs (a driver without them gets a ``skip`` row);
* ``job_memory`` — whether its memory row is the job's own (summary peak, report chart, campaign sizing)
  rather than a private copy's;
* ``carry`` — whether ``pilotrun run --resume`` may keep a parent run's row instead of re-running it
  (:meth:`Gate.recover` then restores what it produced);
* ``on_program`` and ``program_note`` — how it is proven when the job is the user's own program
  (:class:`pilotrun.drivers.OnProgram`), and in words what it proves there or what would enable it.

The pilot, ``--resume``, the console, the HTML report and campaign sizing read these declarations
(:mod:`pilotrun.gates.registry`); none of them keeps its own list of gate names.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..config.exitguard import ExitCalled
from ..config.factories import FactoryInterrupt, FactoryTimeout
from ..drivers.base import Capability, NonFiniteError, OnProgram, TrainingCheckError
from ..interrupt import raised_by_signal
from ..ledger.records import Failure, GateRow, Verdict
from ..measure.meter import StageMeter, is_oom, out_of_memory_reason
from .products import Product
from .view import NotMeasured

if TYPE_CHECKING:
    from .context import PilotContext


# The skip reason of a model-level gate on a bare program: what it needs and what would give it.
# A program whose files use a framework gets the integration that fits it named instead (drivers/program.py).
NEEDS_INTEGRATION = ("needs the model and batches inside the program: an integration records it "
                     "(pilotrun.integrations: the transformers or Lightning Trainer callback, begin() in an accelerate "
                     "or Lightning Fabric loop); a bare script cannot")


@dataclass
class Outcome:
    """What a gate's ``run`` returns; the pilot adds memory, seconds and timestamps to make the row."""

    verdict: Verdict = Verdict.PASS
    reason: str = ""
    inputs: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)
    # Set when the measured work ran in a child process: its counters replace this process's.
    memory: dict | None = None
    failure: Failure | None = None

    def warn(self, reason: str) -> None:
        if self.verdict == Verdict.PASS:
            self.verdict = Verdict.WARN
            self.reason = reason
        elif self.verdict == Verdict.WARN:
            self.reason = f"{self.reason}; {reason}"



@dataclass
class ProbeSite:
    """Where a framework's probes run (OnProgram.INTEGRATION gates' ``probe``): the folder the export probe writes,
    and the outcomes of the probes before (reload_eval reads export's)."""

    export_folder: Path
    outcomes: dict[str, Outcome] = field(default_factory=dict)

class GateFailure(Exception):
    """Raised inside a gate to fail it with a prepared reason (and any inputs/details gathered)."""

    def __init__(self, reason: str, inputs: dict | None = None, details: dict | None = None,
                 failure: Failure = Failure.CHECK) -> None:
        super().__init__(reason)
        self.reason = reason
        self.inputs = inputs or {}
        self.details = details or {}
        self.failure = failure


class Gate:
    """One stage of the pilot. Subclasses set ``name`` and their declarations and implement :meth:`run`."""

    name: ClassVar[str]
    needs: ClassVar[tuple[Product, ...]] = ()
    uses: ClassVar[tuple[Product, ...]] = ()
    produces: ClassVar[tuple[Product, ...]] = ()
    requires: ClassVar[tuple[Capability, ...]] = ()
    job_memory: ClassVar[bool] = False
    carry: ClassVar[bool] = False
    # "stage": the CPU tensor tracker runs for the whole gate; "manual": the gate chooses the tracked
    # block (so timed updates run without tracking overhead).
    tensor_tracking: ClassVar[str] = "stage"
    # Whether a failure reason starts with the shape ("eval at length 4096, batch 8"): only where the
    # shape is what the gate is about.
    shape_in_reason: ClassVar[bool] = False
    # On a program job: how the gate is proven, what it proves there or (skipped) what would enable it, and whether
    # its rows carry the invalid values the program reported (the last selected such gate does, without a RUNS gate).
    on_program: ClassVar[OnProgram] = OnProgram.NEVER
    program_note: ClassVar[str] = ""
    program_problems: ClassVar[bool] = False
    # On a program job: several stages of its name on one rank are combined (median time, largest peaks); False
    # keeps the first (first_step: the update that allocates the optimizer state).
    program_combines: ClassVar[bool] = True
    # OnProgram.INTEGRATION: a hand-written loop's watcher records the gate from the loop's real optimizer steps
    # instead of its probe (integrations/observe.py).
    watched: ClassVar[bool] = False

    @staticmethod
    def probe(view: Any, site: ProbeSite) -> Outcome:
        """OnProgram.INTEGRATION: the gate's check of a framework's view (gates/view.py), run in the program's own
        process by integrations.common.run_probes, in GATES' order."""
        raise NotImplementedError("a gate run on a framework's view (OnProgram.INTEGRATION) defines probe")

    def __init__(self) -> None:
        self.live_inputs: dict | None = None  # what the gate had reached when it failed (see failure_inputs)

    def track(self, ctx: PilotContext) -> list:
        """Objects whose tensors are live before the gate starts (model, optimizer)."""
        return ctx.tracked()

    def run(self, ctx: PilotContext, meter: StageMeter) -> Outcome:  # pragma: no cover - abstract
        raise NotImplementedError

    def recover(self, ctx: PilotContext, row: GateRow) -> bool:
        """For a carried row (``--resume``): put what this gate produced back into ``ctx`` from its parent's row
        and files; False when that is no longer possible (the gate then runs again)."""
        return not self.produces

    def describe_inputs(self, ctx: PilotContext) -> dict:
        return ctx.base_inputs()

    def failure_inputs(self, ctx: PilotContext) -> dict:
        """Inputs for a failure row: what the gate had reached when it failed (``self.live_inputs``)."""
        return dict(self.live_inputs) if self.live_inputs else self.describe_inputs(ctx)


def _user_frame(tb) -> str:
    """The innermost frame outside pilotrun, torch and transformers: usually the user's bug."""
    frames = traceback.extract_tb(tb)
    skip = ("/pilotrun/", "/torch/", "/transformers/", "/site-packages/", "<frozen")
    for fr in reversed(frames):
        if not any(s in fr.filename for s in skip):
            return f" (at {Path(fr.filename).name}:{fr.lineno} in {fr.name})"
    return ""


def stops_the_pilot(exc: BaseException) -> bool:
    """Whether ``exc`` must end the pilot rather than fail one gate: a stop signal (Ctrl-C, exit 130; a
    ``KeyboardInterrupt`` user code raised itself is a failure), a generator closing, or a
    BaseException pilotrun raises itself for control flow (a stop signal). Anything else user code raises,
    SystemExit and any BaseException subclass included, is the gate's failure."""
    if isinstance(exc, KeyboardInterrupt):
        return raised_by_signal(exc)  # user code raising it with no signal sent is the gate's failure
    if isinstance(exc, GeneratorExit):
        return True
    return not isinstance(exc, (Exception, SystemExit)) and type(exc).__module__.startswith("pilotrun.")


def failure_of(exc: BaseException) -> Failure:
    """The kind of failure an exception raised in a gate is."""
    if isinstance(exc, GateFailure):
        return exc.failure
    if is_oom(exc):
        return Failure.OUT_OF_MEMORY
    if isinstance(exc, NonFiniteError):
        return Failure.NON_FINITE
    return Failure.CHECK if isinstance(exc, TrainingCheckError) else Failure.ERROR


def failure_reason(gate: Gate, exc: BaseException, ctx: PilotContext, inputs: dict) -> str:
    """A one-line reason naming the stage and the input that caused the failure."""
    if isinstance(exc, GateFailure):
        return exc.reason
    prefix = f"{gate.name} at {ctx.shape_phrase(inputs)}: " if gate.shape_in_reason else ""
    if (oom := out_of_memory_reason(exc, ctx.device)) is not None:  # which memory, and the allocator's own words
        return f"{gate.name} at {ctx.shape_phrase(inputs)}: {oom}"
    if isinstance(exc, TrainingCheckError):
        return f"{prefix}{exc}"
    if isinstance(exc, ExitCalled):
        return (f"{prefix}the code called os._exit({exc.code!r}){_user_frame(exc.__traceback__)}, which would have "
                "ended pilotrun with no row; raise an exception instead")
    if isinstance(exc, (FactoryTimeout, FactoryInterrupt)):  # their message says where the factory was
        return f"{prefix}{exc}"
    if isinstance(exc, KeyboardInterrupt):  # raised by the code itself, no stop signal (stops_the_pilot)
        return (f"{prefix}the code raised KeyboardInterrupt{_user_frame(exc.__traceback__)} though no stop signal was "
                "sent; raise an exception instead (a KeyboardInterrupt ends pilotrun as Ctrl-C does)")
    if isinstance(exc, SystemExit):
        return (f"{prefix}the code called sys.exit({exc.code!r}){_user_frame(exc.__traceback__)}; raise an exception "
                "instead")
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(message) > 300:
        message = message[:297] + "..."
    hint = next((h for k, h in HINTS if k in message), "")
    return f"{prefix}{type(exc).__name__}: {message}{_user_frame(exc.__traceback__)}{hint}"


# Hints for common errors raised by user code, torch or transformers (their messages, not ours).
HINTS = [
    ("does not require grad", " — the loss is detached from the parameters (computed under no_grad, with .detach() "
                              "or via .item()?)"),
    ("unexpected keyword argument", " — forward(**batch) receives every key the collate returns"),
    ("Target", " — a class index outside the model's output size?"),
]


def fail_outcome(gate: Gate, exc: BaseException, ctx: PilotContext) -> Outcome:
    """A failed gate's outcome from the exception it raised (a check that could not run: ``skip`` with its reason)."""
    if isinstance(exc, NotMeasured):
        return Outcome(Verdict.SKIP, str(exc), gate.describe_inputs(ctx))
    inputs = gate.failure_inputs(ctx)
    if isinstance(exc, GateFailure):
        inputs.update(exc.inputs)
    return Outcome(Verdict.FAIL, failure_reason(gate, exc, ctx, inputs), inputs,
                   dict(getattr(exc, "details", {}) or {}), failure=failure_of(exc))


def run_check(gate: str, check: Callable[[], Outcome]) -> Outcome:
    """A gate's check run outside the pilot's runner (an integration, inside the user's program): its outcome, a
    ``skip`` where it could not measure, a ``fail`` with the reason for a GateFailure, and for anything else the
    exception's first line (traceback in the details) — never an exception into the user's program."""
    try:
        return check()
    except NotMeasured as exc:
        return Outcome(Verdict.SKIP, str(exc))
    except GateFailure as exc:
        return Outcome(Verdict.FAIL, exc.reason, exc.inputs, dict(exc.details), failure=exc.failure)
    except TrainingCheckError as exc:  # an update refused (a non-finite loss): the message is the reason
        return Outcome(Verdict.FAIL, str(exc), failure=failure_of(exc))
    except Exception as exc:  # user code (model, collate, save) raised inside the check: that is the finding
        first = (str(exc).splitlines() or [""])[0][:300]
        return Outcome(Verdict.FAIL, f"{gate} raised {type(exc).__name__}: {first}{_user_frame(exc.__traceback__)}",
                       details={"traceback": traceback.format_exc()[-4000:]}, failure=failure_of(exc))


def on_main_rank(ctx: PilotContext, gate: Gate, work) -> Outcome:
    """Run ``work()`` on rank 0 only and give every rank its outcome (the others wait at the broadcast).

    For gates whose real work happens in fresh processes or on one full copy (restore, resume,
    reload_eval, export): rank 0 must never raise before the broadcast, or the others would wait forever.
    """
    from .. import distributed

    env = ctx.env
    if not env.active:
        return work()
    outcome: Outcome | None = None
    if env.is_main:
        try:
            outcome = work()
        except BaseException as exc:  # user code may raise any BaseException subclass
            if stops_the_pilot(exc):
                raise
            outcome = fail_outcome(gate, exc, ctx)
    shared = distributed.broadcast(env, None if outcome is None else
                                   (str(outcome.verdict), outcome.reason, outcome.inputs, outcome.details,
                                    outcome.memory, outcome.failure and str(outcome.failure)))
    if env.is_main:
        assert outcome is not None
        return outcome
    verdict, reason, inputs, details, memory, failure = shared
    mine = Outcome(Verdict(verdict), f"rank 0 ran it for all ranks: {reason}", {**inputs, "rank": ctx.rank},
                   {"from_rank": 0})
    if mine.verdict == Verdict.FAIL:
        raise GateFailure(mine.reason, inputs=mine.inputs, failure=Failure(failure) if failure else Failure.CHECK)
    return mine

