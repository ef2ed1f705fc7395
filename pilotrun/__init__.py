"""pilotrun: one complete training step, proven gate by gate, before GPUs are rented.

Command line: ``pilotrun run pilot.yaml``. In your own loop::

    import pilotrun
    with pilotrun.stage("first_step", inputs={"seq_len": 2048, "micro_batch": 8}, track=[model, opt]):
        loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()

Your own program, piloted by ``pilotrun run`` (``program:`` in the spec): ``job = pilotrun.program()``
(:mod:`pilotrun.program.handle`).
"""
__version__ = "0.1.0"

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import program
    from .api import Session, StageFailed, StageHandle, session, stage
    from .program import ProgramHandle

# Imported when first used (PEP 562), not with the package: a process that only supervises another (a campaign's run
# of a user's program) reads the ledger and the config and needs no torch, whose import costs a second of CPU and a few
# hundred MB of host memory in each of them.
_LAZY = {"program": ".program", "ProgramHandle": ".program", "Session": ".api", "StageFailed": ".api",
         "StageHandle": ".api", "session": ".api", "stage": ".api"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pilotrun' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    return module if name == "program" else getattr(module, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = ["ProgramHandle", "Session", "StageFailed", "StageHandle", "program", "session", "stage", "__version__"]
