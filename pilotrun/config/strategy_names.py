"""The strategy vocabulary the spec validates ``distributed.strategy`` against: the registry's names, mirrored.

The registry (``pilotrun.strategies.STRATEGIES``) is the authority on which strategies exist, but
config/ is a foundation and may not import it (strategies sit above it and import config's types).
So the names are mirrored here as plain strings and ``pilotrun/strategies/__init__.py`` refuses to
import unless ``NAMES`` is exactly its registry's names in its order, ``DEFAULT`` is its one-process
strategy and every alias leads to a registered name (``strategies.vocabulary_problems``). Every run,
worker and test imports the registry before anything trains, so the two cannot drift apart unseen,
and the spec keeps rejecting an unknown name at load time, naming the field and the choices.

This module is the one place outside ``pilotrun/strategies/`` that spells a strategy's name as a
value (tests/test_architecture.py allows it and nothing else).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

# The registry's names in its order: the spec's choices, as docs/spec.md lists them.
NAMES: tuple[str, ...] = ("single", "ddp", "fsdp")
# The spec's default: one process on one device (the registry's one-process strategy).
DEFAULT = "single"
# Accepted in specs written before the vocabulary was one: `none` meant one process.
ALIASES: dict[str, str] = {"none": "single"}
# The strategies that can keep their sharded state on the host (``distributed.offload: cpu``; the registry's
# ``Strategy.offloads``): FSDP2's CPUOffloadPolicy.
OFFLOADING: tuple[str, ...] = ("fsdp",)

if TYPE_CHECKING:
    StrategyName = str
else:  # a Literal built from NAMES, so the schema's "one of ..." check and docs/spec.md list the registry's names
    StrategyName = Literal[NAMES]
