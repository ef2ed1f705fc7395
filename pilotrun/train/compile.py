"""torch.compile in pilotrun's loop (``train.compile``) and what dynamo's own counters say it cost.

``model`` compiles the whole model; ``blocks`` compiles each repeated block (the longest ``ModuleList``,
:func:`pilotrun.models.structure.repeated_blocks`, which the caller passes: train/ does not import models/) on its
own, as torchtitan's ``apply_compile`` does: the blocks
share one code object, so one graph serves every layer and a compile takes a block's time, not the model's.
Both compile in place (``nn.Module.compile``): the module keeps its class, its parameter names and its state dict
(no ``_orig_mod.`` prefix), so checkpoints, exports and fingerprints are the eager job's. A deep copy drops the
compiled call (``Module.__getstate__``): the private copies the model-level gates check run eager.

Order, as torchtitan's ``parallelize_llama`` does it: activation checkpointing (applied while the model is built),
then the compile, then the strategy's wrap (FSDP2's ``fully_shard`` on the compiled blocks; dynamo runs FSDP2's
hooks eagerly, ``torch._dynamo.config.skip_fsdp_hooks``). fp8's Linear swap comes before the compile too (torchao
recommends compiling float8 training: its casts fuse).

The compile happens on the first call, inside the first update, not here: :func:`dynamo_counts` reads dynamo's
process-wide counters (``torch._dynamo.utils.calculate_time_spent``: its ``total_wall_time`` is every frame's
compile plus every backward compile; ``counters["frames"]``: frames compiled and frames that fell back), and
:func:`counts_since` gives what one stretch of work (an update, an evaluation) compiled.

Example::

    record = apply_compile(model, "blocks", repeated_blocks(model))   # targets ["model.layers.0", ...]
    before = dynamo_counts(); driver.update(); spent = counts_since(before)   # spent.seconds, spent.graphs
"""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from .. import backends
from ..ledger.records import GateName

# torch.compile's backend. Inductor is what users compile with; a test may swap in "aot_eager" (the same dynamo
# and AOT autograd path without generating and building C++/Triton kernels: 2.8 s instead of ~20 s here).
BACKEND = "inductor"

# What a user can do when varying lengths recompile: the fix words every recompile warning ends with.
RECOMPILE_FIX = ("pad batches to a few fixed lengths (data.max_length with padding), mark the length dynamic "
                 "(torch._dynamo.mark_dynamic) or raise torch._dynamo.config.recompile_limit")


@dataclass
class CompileRecord:
    """What :func:`apply_compile` compiled: the scope, the module names and the backend."""

    scope: str
    targets: list[str] = field(default_factory=list)
    backend: str = BACKEND

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DynamoCounts:
    """dynamo's counters at one moment, or their growth over a stretch of work (:func:`counts_since`)."""

    seconds: float = 0.0       # compile wall time: frames (dynamo + the forward's backend) and backward compiles
    graphs: int = 0            # frames compiled into a graph
    fell_back: int = 0         # frames dynamo gave up on (recompile limit, an error): those run eager

    def to_dict(self) -> dict:
        return {"compile_seconds": round(self.seconds, 3), "graphs_compiled": self.graphs,
                "frames_run_eager": self.fell_back}


COUNT_KEYS = ("compile_seconds", "graphs_compiled", "frames_run_eager")


def summed(extras: list[dict]) -> DynamoCounts | None:
    """The counts several updates' records carry (``UpdateRecord.extra``, the resume worker's records) added up;
    None when none carries them (an eager job)."""
    rows = [e for e in extras if isinstance(e, dict) and "compile_seconds" in e]
    if not rows:
        return None
    return DynamoCounts(sum(float(e["compile_seconds"]) for e in rows), sum(int(e["graphs_compiled"]) for e in rows),
                        sum(int(e.get("frames_run_eager") or 0) for e in rows))


Blocks = tuple[str, list[torch.nn.Module]]  # repeated_blocks(model): the ModuleList's name and its children


def compile_targets(model: torch.nn.Module, scope: str, blocks: Blocks) -> list[tuple[str, torch.nn.Module]]:
    """The (name, module) pairs ``scope`` compiles: the model itself, or each of ``blocks``. A model without a
    ``ModuleList`` of at least two blocks has no blocks to compile: ``[]`` (:func:`apply_compile` refuses it)."""
    if scope == "model":
        return [("", model)]
    name, layers = blocks
    if scope == "blocks" and len(layers) > 1:
        return [(f"{name}.{i}", b) for i, b in enumerate(layers)]
    return []


def apply_compile(model: torch.nn.Module, scope: str, blocks: Blocks,
                  backend: str | None = None) -> CompileRecord | None:
    """Compile ``model`` in place as ``train.compile`` says (None for ``off``). A transformers model's KV cache is
    turned off first (``config.use_cache``): training never reads it, and the cache object's per-layer state is a
    guard that recompiles every block (measured: 10 Llama blocks, 8 graphs, then the recompile limit)."""
    if scope == "off":
        return None
    targets = compile_targets(model, scope, blocks)
    if not targets:
        raise ValueError("train.compile: blocks needs a model with repeated blocks (a ModuleList of two or more "
                         "layers); this model has none: use compile: model")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    chosen = backend or BACKEND
    for _, module in targets:
        module.compile(backend=chosen)
    return CompileRecord(scope, [name or "(whole model)" for name, _ in targets], chosen)


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs compiled: a ``torch.compile(module)`` wrapper or a module compiled in place."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def compiled_scope(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> str | None:
    """How a user's model is compiled, in ``train.compile``'s words: ``model`` (the whole model, wrapped or in
    place), ``blocks`` (at least one of its repeated ``blocks`` compiled on its own) or None (eager as far as can
    be seen)."""
    if is_compiled(model):
        return "model"
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, torch.nn.Module) and is_compiled(inner):
        return "model"
    if any(is_compiled(b) for b in blocks):
        return "blocks"
    return None


@contextlib.contextmanager
def outside_dispatch_modes(compiled: bool) -> Iterator[bool]:
    """Run a compiled model's call with no TorchDispatchMode active (yields whether one was paused). dynamo skips a
    frame called under a non-infra dispatch mode -- pilotrun's CPU tensor tracker is one -- and marks its code
    skipped for good (``convert_frame``: "non-infra torch dispatch mode present"): measured on the demo, the model
    then ran eager for the rest of the process, with 0 graphs compiled. The tracker sees nothing while paused: the
    caller says so in its row."""
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

    if not compiled or not _get_current_dispatch_mode_stack():
        yield False
        return
    with _disable_current_modes():
        yield True


def dynamo_counts() -> DynamoCounts:
    """dynamo's process-wide counters now (all zero before anything compiled)."""
    from torch._dynamo.utils import calculate_time_spent, counters

    frames = counters["frames"]
    ok = int(frames.get("ok", 0))
    return DynamoCounts(float(calculate_time_spent().get("total_wall_time", 0.0)), ok,
                        max(0, int(frames.get("total", 0)) - ok))


def counts_since(before: DynamoCounts) -> DynamoCounts:
    """What was compiled since ``before`` (dynamo's counters only grow, unless something reset them: then all)."""
    now = dynamo_counts()
    if now.graphs < before.graphs or now.seconds < before.seconds:
        return now
    return DynamoCounts(now.seconds - before.seconds, now.graphs - before.graphs, now.fell_back - before.fell_back)


def recompile_warning(spent: DynamoCounts, where: str, timed: bool = True) -> str | None:
    """The warning for graphs compiled after the first update (``where``: "steady steps", "eval", ...), or None
    when nothing recompiled and nothing fell back to eager. ``timed``: ``spent.seconds`` are the recompiles' own."""
    words = []
    if spent.graphs:
        took = f" ({spent.seconds:.1f} s)" if timed else ""
        words.append(f"{spent.graphs} recompile(s) during {where}{took}: a new shape (a new length or batch size) "
                     "compiles the graph again")
    if spent.fell_back:
        words.append(f"{spent.fell_back} frame(s) fell back to eager during {where} (dynamo's recompile limit or "
                     "an error: those run uncompiled)")
    return f"{'; '.join(words)}; fix: {RECOMPILE_FIX}" if words else None


def compiler_problem(device: torch.device) -> str | None:
    """Why inductor cannot build kernels for ``device`` in this process, or None. CPU kernels are C++ built by the
    compiler torch searches for (``torch._inductor.config.cpp.cxx``: ``CXX``, else g++); CUDA and ROCm
    kernels are Triton's, whose launcher is C built at first use (``CC``, else gcc/clang/cc). Windows (torch's
    ``cl`` lookup) is not checked."""
    if device.type == "cpu":
        from torch._inductor import config

        # The names torch searches (config.cpp.cxx: CXX, else g++; None is its opt-in conda install), looked up
        # on PATH without running them: check_job starts no process.
        search = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
        names = [c for c in search if c]
        if not any(shutil.which(c) for c in names):
            return (f"inductor builds CPU kernels with a C++ compiler and none of {names} is on PATH: install g++ "
                    "(or set CXX)")
        return None
    if backends.for_device(device).name in ("cuda", "rocm"):
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor builds GPU kernels with Triton and it is not installed (or has no driver here)"
        if not any(shutil.which(c) for c in (os.environ.get("CC") or "", "gcc", "clang", "cc") if c):
            return "Triton builds its kernel launcher with a C compiler and none was found: install gcc (or set CC)"
    return None


def compile_problems(scope: str, device: torch.device) -> list[tuple[str, str]]:
    """The spec's problems with ``train.compile`` on this device, each (field, message naming the fix); [] for
    ``off``. Run before anything is built (``drivers.build.check_job``: exit 2)."""
    if scope == "off":
        return []
    why = compiler_problem(device)
    if why is None:
        return []
    return [("train.compile", f"{why}; or set train.compile: off (eager) on this machine")]


# What a measured stage of a program says where the CPU tensor tracker would stop dynamo from compiling its model.
UNTRACKED = ("not measured: the model is compiled, and the CPU tensor tracker is a dispatch mode under which "
             "torch.compile does not compile (dynamo skips that code for good): tensors not tracked, host RSS sampled")


def holds_compiled(track: list) -> bool:
    """Whether a module among a stage's tracked objects runs compiled, whole or in part. Asked only where the program
    imported dynamo (a compile needs it): an eager program pays nothing."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return False
    return any(isinstance(obj, torch.nn.Module) and any(is_compiled(m) for m in obj.modules()) for obj in track)


class StageCompile:
    """What torch.compile did during one measured stage of a program (``api.Session.stage``): dynamo's counters
    before and after, read only where the program imported dynamo."""

    def __init__(self, track: list) -> None:
        import sys

        self.compiled = holds_compiled(track)
        self.before = dynamo_counts() if "torch._dynamo" in sys.modules else DynamoCounts()

    def outcome(self, name: str, first: bool) -> tuple[dict | None, str | None, str | None]:
        """(the row's ``compile`` detail, words for its reason, a warning) for stage ``name``; ``first``: the first
        stage of that name. All None where nothing compiled and no compiled model was tracked (an eager program)."""
        import sys

        if "torch._dynamo" not in sys.modules:
            return None, None, None
        spent = counts_since(self.before)
        if not (self.compiled or spent.graphs or spent.fell_back):
            return None, None, None
        detail = spent.to_dict()
        said = (f"torch.compile: {spent.graphs} graph(s) compiled in {spent.seconds:.1f} s within it"
                if spent.graphs else None)
        warning = None
        if name == GateName.STEADY_STEP or (name == GateName.FIRST_STEP and not first):
            warning = recompile_warning(spent, "steady steps")
        elif spent.fell_back:
            warning = recompile_warning(DynamoCounts(fell_back=spent.fell_back), f"the {name} stage")
        return detail, said, warning
