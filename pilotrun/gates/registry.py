"""The gates in the order they run, and everything derived from their declarations.

Dependencies come from what each gate ``needs`` and which gate ``produces`` it; the lists other
modules need (the gates whose memory is the job's, the gates ``--resume`` may carry) are read
from the declarations here, never written out elsewhere.

Adding a gate: its module in ``pilotrun/gates/``, its line in ``GATES`` and every other file it touches, in
``pilotrun/gates/README.md``; how it runs on the user's own program is its own declaration (``Gate.on_program``),
read by the program driver.

Example::

    gates, notes = select_gates(["eval"])   # [LockGate?..] eval and what it needs: load
    depends_on(BY_NAME["restore"])          # ("save",)
"""
from __future__ import annotations

from ..ledger.records import GateName
from .accum import AccumEquivalenceGate
from .base import Gate, OnProgram
from .batch import BatchGate
from .eval import EvalGate
from .export import ExportGate
from .inspect import InspectGate
from .load import LoadGate
from .lock import LockGate
from .overfit import OverfitGate
from .products import CONTEXT_PRODUCTS, Product
from .reload_eval import ReloadEvalGate
from .restore import RestoreGate
from .resume import ResumeGate
from .save import SaveGate
from .split import SplitGate
from .steps import FirstStepGate, SteadyStepGate

# The order of the pipeline (README, "The gates"): a producer always comes before the gates that need it.
GATES: tuple[type[Gate], ...] = (
    LockGate, InspectGate, SplitGate, BatchGate, LoadGate, FirstStepGate, SteadyStepGate, AccumEquivalenceGate,
    EvalGate, SaveGate, ExportGate, RestoreGate, ResumeGate, OverfitGate, ReloadEvalGate,
)
GATE_NAMES = [g.name for g in GATES]
BY_NAME = {g.name: g for g in GATES}


class UnknownGate(ValueError):
    """Gate names that are not in the registry; ``unknown`` lists them, the message lists the known ones."""

    def __init__(self, unknown: list[str]) -> None:
        self.unknown = unknown
        super().__init__(f"unknown gate(s) {unknown}; known: {', '.join(GATE_NAMES)}")


def producer_of(product: Product) -> type[Gate] | None:
    return next((g for g in GATES if product in g.produces), None)


def depends_on(gate: type[Gate]) -> tuple[str, ...]:
    """The gates producing what ``gate`` needs, nearest first (the one named when it is skipped)."""
    producers = {p.name for p in (producer_of(n) for n in gate.needs) if p is not None}
    return tuple(g for g in reversed(GATE_NAMES) if g in producers)


def upstream_carried(gate: type[Gate]) -> tuple[str, ...]:
    """Carryable gates whose products ``gate`` needs or uses: its row may be carried only with theirs."""
    out = []
    for product in (*gate.needs, *gate.uses):
        p = producer_of(product)
        if p is not None and p.carry:
            out.append(p.name)
    return tuple(out)


def job_memory_gates() -> tuple[str, ...]:
    """Gates whose memory row is the job's own: the summary's peak, the report's chart, campaign sizing."""
    return tuple(g.name for g in GATES if g.job_memory)


def select_gates(requested: list[str] | None) -> tuple[list[type[Gate]], list[str]]:
    """The gates to run in order, with prerequisites added; and a note per added prerequisite."""
    if not requested:
        return list(GATES), []
    unknown = [g for g in requested if g not in BY_NAME]
    if unknown:
        raise UnknownGate(unknown)
    wanted = set(requested)
    notes = []
    changed = True
    while changed:
        changed = False
        for name in sorted(wanted, key=GATE_NAMES.index):
            for dep in depends_on(BY_NAME[name]):
                if dep not in wanted:
                    wanted.add(dep)
                    notes.append(f"{dep} added: {name} needs it")
                    changed = True
    return [g for g in GATES if g.name in wanted], notes


def problems() -> list[str]:
    """What is wrong with the declarations (each product made by one gate, before the gates that read it)."""
    out = []
    for product in Product:
        makers = [g.name for g in GATES if product in g.produces]
        if product in CONTEXT_PRODUCTS:
            if makers:
                out.append(f"{product.value} is provided by the context, yet {makers} produce it")
            continue
        if len(makers) != 1:
            out.append(f"{product.value} is produced by {makers or 'no gate'}; exactly one must produce it")
    for i, gate in enumerate(GATES):
        for product in (*gate.needs, *gate.uses):
            maker = producer_of(product)
            if maker is not None and GATE_NAMES.index(maker.name) >= i:
                out.append(f"{gate.name} reads {product.value}, produced later by {maker.name}")
    for gate in GATES:  # a skip row on a program must say what would enable the gate; a stage, which one to report
        if gate.on_program != OnProgram.PILOT and not gate.program_note:
            out.append(f"{gate.name} declares on_program {gate.on_program} without a program_note")
        if gate.on_program == OnProgram.INTEGRATION and gate.probe is Gate.probe:
            out.append(f"{gate.name} runs on a framework's view (on_program integration) without a probe")
    if len(set(GATE_NAMES)) != len(GATE_NAMES):
        out.append("two gates share a name")
    # Readers compare rows with GateName, so the enum is the vocabulary: a gate named outside it, or out of order,
    # would be missed by them (the console's steady_step time, the plan's measured items).
    plain = [str(g.name) for g in GATES if not isinstance(g.name, GateName)]
    if plain:
        out.append(f"gate names not taken from ledger.records.GateName: {plain}")
    if [str(n) for n in GATE_NAMES] != [str(n) for n in GateName]:
        out.append(f"GateName and GATES must list the same gates in the same order: GateName "
                   f"{[str(n) for n in GateName]}, GATES {[str(n) for n in GATE_NAMES]}")
    return out


_problems = problems()
if _problems:  # a declaration bug, caught at import rather than as a confusing skip
    raise RuntimeError("gate declarations: " + "; ".join(_problems))
