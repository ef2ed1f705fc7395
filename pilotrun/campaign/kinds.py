"""What differs between a campaign of pilotrun's loop and one of the user's program, in one table keyed by the
base spec's kind (:class:`pilotrun.config.spec.JobKind`, decided once by ``Spec.kind``). The worker, the engines,
the orchestrator and the follow-ups take these from here; none of them asks which kind a spec is.

Example::

    side = KINDS[spec.kind]
    run = side.run()                         # runner.train_run, or program_run.record_program_run
    side.seeds_share_spec, side.varied("train.optimizer.lr")
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.spec import JobKind

RunFunction = Callable[..., dict]


def _loop_run() -> RunFunction:
    from .runner import train_run  # imports torch: the loop's run builds the job in this process

    return train_run


def _program_run() -> RunFunction:
    from .program_run import record_program_run  # no torch: this process only supervises the program

    return record_program_run


@dataclass(frozen=True)
class CampaignKind:
    """One kind's campaign: how a run is run and recorded, and what may differ between its runs."""

    run: Callable[[], RunFunction]   # the function that runs and records one run (imported when asked)
    seeds_share_spec: bool           # a further seed is the value's spec with only the seed set
    templated: tuple[str, ...]       # spec keys the campaign's templates fill per run (they differ by design)
    continues_from_checkpoint: bool  # a continued run resumes from the last checkpoint its run reported
    spec_schedule: bool              # the learning-rate schedule is the spec's (its warm-up is checked)
    over_nodes: bool                 # a run may span several nodes (engines/nodes.py)

    def varied(self, key: str) -> tuple[str, ...]:
        """The keys a variant's spec may differ in from the control's: the varied key, or the templated ones."""
        return self.templated or (key,)


KINDS: dict[JobKind, CampaignKind] = {
    JobKind.LOOP: CampaignKind(_loop_run, seeds_share_spec=True, templated=(), continues_from_checkpoint=False,
                               spec_schedule=True, over_nodes=True),
    # A program's seed and value reach it through its command and environment, so every run's spec is built from
    # the templates; its schedule is its own, and its runs start its own launcher on one node.
    JobKind.PROGRAM: CampaignKind(_program_run, seeds_share_spec=False, templated=("program.command", "program.env"),
                                  continues_from_checkpoint=True, spec_schedule=False, over_nodes=False),
}


def of(spec_or_campaign: Any) -> CampaignKind:
    """The campaign side of a spec, or of a campaign file (whose kind is its base's)."""
    return KINDS[spec_or_campaign.kind]
