"""The interface every campaign engine implements, and the user's choice of engine.

An engine runs one planned run at a time per calling thread (``launch`` blocks until the run ends);
the orchestrator calls it from as many threads as runs may go at once. The rules every engine keeps:

- the run's row exists (planned, then running) before ``launch``; the engine never creates or replaces
  one, and a run it could not start or lost is left open for the orchestrator's ``record_lost_end``, or
  ended by the engine itself with a ``StopKind`` that says what happened (never by matching messages);
- ``started`` holds the ids of runs that really began training (a lost end is then "stopped", else
  "not run"); ``stopping`` is set once the campaign stops, after which ``launch`` starts nothing;
- ``stop_all(how)`` asks every running run to stop at its next update and waits a bounded time.

Example::

    choice = EngineChoice("ray", address="10.0.0.5:6379", storage=Path("/shared/runs"))
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from .nodes import Leader

ENGINES = ("local", "ray")


class EngineRefusal(Exception):
    """The engine cannot run the campaign as declared (e.g. GPUs asked of a cluster with none): the message names the
    fix. The orchestrator reports it as a CampaignError (exit 2)."""


@dataclass(frozen=True)
class EngineChoice:
    """``--engine``, ``--address`` (an existing Ray cluster; None: a local Ray instance) and ``--storage`` (where
    the runs' checkpoints, exports and predictions go; None: beside the campaign's own folder). ``nodes``: on node 0
    of a cluster every run spans (``--nnodes``), its open link to the other nodes (engines/nodes.py)."""

    name: Literal["local", "ray"] = "local"
    address: str | None = None
    storage: Path | None = None
    nodes: Leader | None = None


class Engine(Protocol):
    started: set[str]
    stopping: threading.Event
    how: str  # what stopped the campaign ("Ctrl-C", "SIGTERM", ...), for the stopped rows' reason

    def launch(self, r: dict, ledger: Path, plan_file: Path, deadline: float | None,
               threads: int | None) -> None: ...

    def stop_all(self, how: str) -> None: ...


class ClusterEngine(Engine, Protocol):
    """An engine that schedules the runs itself (Ray): it says how many go at once and what each asks for."""

    def plan(self, requested: int | None, runs: int, spec, per_run, processes: int = 1) -> dict: ...
