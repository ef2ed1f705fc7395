"""The strategy registry: single, DDP and FSDP2, one object each (see ``base.Strategy``).

One vocabulary everywhere: ``distributed.strategy`` in the spec, ``--strategy`` of ``estimate``,
the advisor's variants and the ledger use these names. Adding a strategy is one module here and
one line in ``STRATEGIES``, and its name in ``config/strategy_names.py``: the spec validates
against that mirror (config/ cannot import this package) and this module refuses to import
while the two differ (:func:`vocabulary_problems`).

Callers ask the objects and the registry, never compare names: ``get(name).shards``,
``one_process()`` (what one process runs), ``sharding()`` (the advisor's sharding fix).

Example::

    from pilotrun import strategies
    strategies.get("fsdp").data_replicas(4)   # 4
    strategies.for_processes("ddp", 1).name    # "single": one process is single whatever the spec says
    strategies.sharding().name                 # "fsdp"
"""
from __future__ import annotations

from typing import Any

from ..config import strategy_names
from ..distributed import LaunchError
from .base import BufferSync, StageBytes, Strategy, correction
from .ddp import DDP
from .fsdp import FSDP
from .single import Single

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Single(), DDP(), FSDP())}
# Accepted in specs written before the vocabulary was one (`none` meant one process); declared with the mirror.
ALIASES = strategy_names.ALIASES


class UnknownStrategy(ValueError):
    """A strategy name that is not in the registry; the message lists the choices."""


class ProcessMismatch(LaunchError):
    """The processes launched and the spec's strategy disagree; the message says what to change."""


def names() -> list[str]:
    return list(STRATEGIES)


def one_process() -> Strategy:
    """The strategy one process runs: the registry's one that is not multi-process."""
    return next(s for s in STRATEGIES.values() if not s.multi_process)


def sharding() -> Strategy:
    """The strategy the advisor proposes when parameters, gradients and optimizer state must be split over GPUs:
    the registry's first that shards."""
    return next(s for s in STRATEGIES.values() if s.shards)


def vocabulary_problems(registry: dict[str, Strategy], mirror: Any = strategy_names) -> list[str]:
    """Where the spec's mirror of the names (``config/strategy_names.py``) and ``registry`` differ; [] when equal."""
    problems = []
    if tuple(registry) != tuple(mirror.NAMES):
        problems.append(f"the spec's choices {list(mirror.NAMES)} are not the registry's {list(registry)}")
    single = [n for n, s in registry.items() if not s.multi_process]
    if single != [mirror.DEFAULT]:
        problems.append(f"the spec's default {mirror.DEFAULT!r} is not the one-process strategy {single}")
    problems += [f"the alias {old!r} names {new!r}, which is not registered"
                 for old, new in mirror.ALIASES.items() if new not in registry]
    offloading = [n for n, s in registry.items() if s.offloads]
    if list(mirror.OFFLOADING) != offloading:
        problems.append(f"the spec's offloading strategies {list(mirror.OFFLOADING)} are not the registry's "
                        f"{offloading}")
    return problems


def multi_process_names() -> list[str]:
    return [n for n, s in STRATEGIES.items() if s.multi_process]


def get(name: str) -> Strategy:
    key = ALIASES.get(name, name)
    if key not in STRATEGIES:
        choices = ", ".join(f"{n} ({s.description})" for n, s in STRATEGIES.items())
        raise UnknownStrategy(f"unknown strategy {name!r}; choose one of: {choices}")
    return STRATEGIES[key]


def for_processes(name: str, world_size: int, offload: str = "none", precision: str = "fp32") -> Strategy:
    """The strategy that runs ``world_size`` processes of a spec asking for ``name`` (with ``distributed.offload``
    and ``train.precision``): one process is always single, which cannot offload, so a spec asking for offload there
    is refused rather than run without it."""
    declared = get(name)
    if world_size > 1 and not declared.multi_process:
        raise ProcessMismatch(f"{world_size} processes were launched but distributed.strategy is {declared.name!r}: "
                              f"set it to {' or '.join(multi_process_names())}")
    chosen = declared if world_size > 1 else one_process()
    if offload != "none" and not chosen.offloads:
        which = f"{world_size} process{'es' if world_size > 1 else ''}"
        raise ProcessMismatch(f"distributed.offload is {offload!r} but {which} run {chosen.name!r}, which keeps its "
                              f"state on the device: launch 2 or more processes (pilotrun launch --nproc-per-node N) "
                              f"of distributed.strategy {' or '.join(n for n, s in STRATEGIES.items() if s.offloads)}, "
                              "or set distributed.offload: none")
    return chosen.configured(offload, precision)


_problems = vocabulary_problems(STRATEGIES)
if _problems:  # not an assert: the check must hold under python -O as well
    raise ImportError("pilotrun/config/strategy_names.py must mirror pilotrun.strategies.STRATEGIES: "
                      + "; ".join(_problems))


__all__ = ["ALIASES", "STRATEGIES", "BufferSync", "ProcessMismatch", "StageBytes", "Strategy", "UnknownStrategy",
           "correction", "for_processes", "get", "multi_process_names", "names", "one_process", "sharding",
           "vocabulary_problems"]
