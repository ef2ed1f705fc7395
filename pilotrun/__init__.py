"""pilotrun: one complete training step, proven gate by gate, before GPUs are rented.

Command line: ``pilotrun run pilot.yaml``. In your own loop::

    import pilotrun
    with pilotrun.stage("first_step", inputs={"seq_len": 2048, "micro_batch": 8}, track=[model, opt]):
        loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()

Your own program, piloted by ``pilotrun run`` (``program:`` in the spec): ``job = pilotrun.program()``
(:mod:`pilotrun.program.handle`).
"""
__version__ = "0.1.0"

from . import program  # noqa: E402  (callable: job = pilotrun.program(); see pilotrun.program.handle)
from .api import Session, StageFailed, StageHandle, session, stage  # noqa: E402
from .program import ProgramHandle  # noqa: E402

__all__ = ["ProgramHandle", "Session", "StageFailed", "StageHandle", "program", "session", "stage", "__version__"]
