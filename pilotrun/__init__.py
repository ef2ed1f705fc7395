"""pilotrun: one complete training step, proven gate by gate, before GPUs are rented.

Command line: ``pilotrun run pilot.yaml``. In your own loop::

    import pilotrun
    with pilotrun.stage("first_step", inputs={"seq_len": 2048, "micro_batch": 8}, track=[model, opt]):
        loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()
"""
__version__ = "0.1.0"

from .api import Session, StageFailed, StageHandle, session, stage  # noqa: E402

__all__ = ["Session", "StageFailed", "StageHandle", "session", "stage", "__version__"]
