"""The one way a job is set up in a process: its place among the processes, its inputs, and its driver.

The pilot's own process (the ``load`` gate) and every fresh worker process (restore, resume,
campaign runs) call these same functions in the same order with the same seeds — the bitwise
resume proof depends on it, so there is no second copy to keep in step.

Example::

    process = join_job(spec)            # device, process group, strategy
    inputs = load_inputs(spec)          # tokenizer and datasets
    driver = build_driver(spec, inputs, process)
    record = driver.update()
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .. import backends, distributed, strategies
from ..config.sections import BF16_WEIGHTS
from ..config.spec import JobKind
from ..data.bundle import build_data
from ..devices import device_name, pick_device
from ..models.loading import load_tokenizer
from ..train.rng import seed_everything
from .base import Driver, JobInputs, JobProcess, RunSite
from .loop import LoopDriver
from .program import ProgramDriver

# Whatever runs the updates, by the spec's kind: pilotrun's own loop, or the user's own program (``program:``).
DRIVERS: dict[JobKind, type[Driver]] = {JobKind.LOOP: LoopDriver, JobKind.PROGRAM: ProgramDriver}


def driver_class(spec) -> type[Driver]:
    """The driver a spec asks for: ``program:`` names the user's program, else pilotrun's loop runs the factories."""
    return DRIVERS[spec.kind]


def join_job(spec) -> JobProcess:
    """Pick the device, resolve the strategy for the processes launched, and join their process group.

    A program job's pilot is one process that starts the program (which launches its own ranks and picks its own
    devices): it joins no group."""
    if not driver_class(spec).in_process:
        strategy = strategies.for_processes(spec.distributed.strategy, 1)  # one process: single
        return JobProcess(torch.device("cpu"), "the program picks its own devices", "cpu", distributed.DistEnv(),
                          strategy)
    device, reason = pick_device(spec.train.device)
    _, _, world = distributed.env_from_os()
    strategy = strategies.for_processes(spec.distributed.strategy, world, spec.distributed.offload,
                                        spec.train.precision)
    env = distributed.init(strategy.name, device.type)
    runtime = backends.for_device(device)
    if env.active and runtime.indexed:  # one device per process
        device = runtime.device(env.local_rank)
        reason = f"LOCAL_RANK {env.local_rank} chooses {device}"
    return JobProcess(device, reason, device_name(device), env, strategy)


def check_job(spec, device: torch.device) -> None:
    """Before anything runs: the spec's adapter fits the model and the optimizer exists for this device, or
    :class:`SpecError` (exit 2) naming the field and the fix. The model is built on the meta device (no weights,
    no memory) to read its Linear layers' names."""
    from ..config.schema import SpecError
    from ..models.loading import ModelError, build_model
    from ..train.compile import compile_problems
    from ..train.fp8 import fp8_problems
    from ..train.optim import OptimizerError, choose_fused

    if not driver_class(spec).in_process:
        return  # the program builds its own model and optimizer; its spec section was checked when loaded
    problems: list[tuple[str, str]] = []
    if spec.model.adapter is not None and spec.model.adapter.target_modules != "all-linear":
        builder = "model.factory" if spec.model.factory is not None else "model"
        try:
            build_model(spec.model, spec.build_context(), None, None, meta=True, activation_checkpointing=False)
        except ModelError as exc:
            field = exc.field or builder
            problems.append((field, str(exc).removeprefix(f"{field}: ")))
        except Exception as exc:  # the user's factory raised (found by the fuzzer: exit 3, an internal error)
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            problems.append((builder, f"building the model on the meta device (to check model.adapter.target_modules "
                             f"against its Linear layers) raised {type(exc).__name__}: {first}; fix the factory "
                             "or the keys it reads"))
    problems += fp8_problems(spec.train.precision, device, spec.model.adapter, spec.model.quantization)
    problems += compile_problems(spec.train.compile, device)
    if spec.train.compile == "blocks" and not problems:
        problems += _blocks_problem(spec)
    dtype = torch.bfloat16 if spec.train.precision in BF16_WEIGHTS else torch.float32
    try:
        choose_fused(spec.train.optimizer, device, {dtype})
    except OptimizerError as exc:
        problems.append((exc.field, str(exc)))
    if problems:
        raise SpecError(problems, spec.source)


def _blocks_problem(spec) -> list[tuple[str, str]]:
    """``train.compile: blocks`` on a model without repeated blocks, as (field, message) pairs: the model is built on
    the meta device (no weights) to find them. A model that does not build is left to the load gate to report."""
    from ..models.loading import build_model
    from ..models.structure import repeated_blocks
    from ..train.compile import compile_targets

    try:
        built = build_model(spec.model, spec.build_context(), None, None, meta=True, activation_checkpointing=False)
    except Exception:  # the adapter check above or the load gate names what is wrong with the model itself
        return []
    if compile_targets(built.model, "blocks", repeated_blocks(built.model)):
        return []
    return [("train.compile", "blocks compiles each repeated block (a ModuleList of two or more layers) and this "
                              "model has none: use compile: model (the whole model) or off")]


def load_inputs(spec) -> JobInputs:
    """Tokenizer and datasets, seeded first (a factory may draw from the global generators)."""
    seed_everything(spec.seed)
    tokenizer = load_tokenizer(spec.model, spec.folder) if spec.data.task is not None else None
    return JobInputs(tokenizer, build_data(spec.data, spec.build_context(), tokenizer, spec.eval_max_length))


def build_driver(spec, inputs: JobInputs | None, process: JobProcess,
                 on_model: Callable[[torch.nn.Module], None] | None = None, site: RunSite | None = None) -> Driver:
    """The spec's driver, built (model seeded, moved to the device, wrapped by the strategy) and ready to update.

    ``on_model`` sees the plain model on the device before it is wrapped (the load gate's meter counts it);
    ``site`` is the pilot's run, where a driver that starts processes of its own (the program) writes."""
    return driver_class(spec).build(spec, inputs, process, on_model, site)


def build_job(spec) -> Driver:
    """In a fresh process (a worker): join the job, load its inputs and build its driver — the load gate's steps."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    process = join_job(spec)
    return build_driver(spec, load_inputs(spec), process)
