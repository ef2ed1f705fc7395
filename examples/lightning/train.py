"""A Lightning fit on synthetic regression data — with the lines pilotrun needs (marked ``# pilotrun``).

    python train.py                      # trains normally (the handle is inert)
    pilotrun run pilot.yaml              # pilots it gate by gate
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as L

import pilotrun
from pilotrun.integrations.lightning import PilotrunCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
import points  # noqa: E402

job = pilotrun.program()  # pilotrun

L.seed_everything(0)
trainer = L.Trainer(max_steps=16, accumulate_grad_batches=2, val_check_interval=6, limit_val_batches=2,
                    # one process, or each of torchrun's (`torchrun --nproc-per-node 2 train.py`: gloo DDP on CPU)
                    accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")),
                    strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto",
                    logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir="out",
                    callbacks=[PilotrunCallback()])  # pilotrun
with job.stage("load"):  # pilotrun (optional: measures the module's construction)
    module = points.Regressor()
trainer.fit(module, points.loader(96), points.loader(16, seed=1, shuffle=False),
            ckpt_path=job.resume_from)  # pilotrun: resume where the pilot asks
