"""What every run of a campaign is told: its updates, validation, stop rules, what it keeps, its ranks and threads.

Typed here, a JSON object only on the wire: the campaign's ``plan.json`` (read by each local worker, and again
by ``--resume``) and a Ray task's argument. The JSON keeps the layout campaigns have always written, so a campaign
started by an earlier pilotrun resumes with it.

Example::

    plan = CampaignRunPlan.of(campaign).with_threads(1)
    (folder / "plan.json").write_text(json.dumps(plan.to_json()))
    CampaignRunPlan.from_json(json.loads((folder / "plan.json").read_text())).updates
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .spec import CampaignSpec


@dataclass(frozen=True)
class CampaignRunPlan:
    updates: int                       # each run's optimizer updates
    eval_every: int                    # validation every this many updates, and after the last
    stop: dict[str, Any] = field(default_factory=dict)  # the campaign's stop section, canonical (StopRules reads it)
    keep_checkpoint: bool = True       # a finished run keeps its final training checkpoint
    keep_export: bool = True           # a finished run keeps its inference artifact
    control_set: int = 16              # validation examples whose predictions every run keeps
    processes: int = 1                 # ranks per run: above 1, a torchrun group (pilotrun's loop)
    threads: int | None = None         # torch threads per process: runs side by side share the cores (None: torch's)

    @classmethod
    def of(cls, c: CampaignSpec) -> CampaignRunPlan:
        keep = c.canonical()["keep"]
        return cls(updates=c.updates, eval_every=c.eval.every, stop=c.canonical()["stop"],
                   keep_checkpoint=bool(keep["checkpoint"]), keep_export=bool(keep["export"]),
                   control_set=int(keep["control_set"]), processes=c.ranks)

    def with_threads(self, threads: int | None) -> CampaignRunPlan:
        return replace(self, threads=threads)

    def to_json(self) -> dict[str, Any]:
        return {"updates": self.updates, "eval_every": self.eval_every, "stop": self.stop,
                "keep": {"checkpoint": self.keep_checkpoint, "export": self.keep_export,
                         "control_set": self.control_set},
                "processes": self.processes, "threads": self.threads}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CampaignRunPlan:
        keep = d.get("keep") or {}
        return cls(updates=int(d["updates"]), eval_every=int(d["eval_every"]), stop=dict(d.get("stop") or {}),
                   keep_checkpoint=bool(keep.get("checkpoint", True)), keep_export=bool(keep.get("export", True)),
                   control_set=int(keep.get("control_set", 16)), processes=int(d.get("processes") or 1),
                   threads=int(d["threads"]) if d.get("threads") else None)
