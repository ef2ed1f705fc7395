"""TRL's ``DPOTrainer``, a preference trainer, on a ``datasets.Dataset`` of prompt/chosen/rejected additions — with the
lines pilotrun needs (marked ``# pilotrun``). The reference model is the same initial model (the same seed), frozen.

    python dpo.py                        # trains normally (the handle is inert)
    pilotrun run dpo.yaml                # pilots it gate by gate
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from trl import DPOConfig, DPOTrainer

import pilotrun  # pilotrun
from pilotrun.integrations.transformers import PilotrunCallback  # pilotrun

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sums  # noqa: E402

job = pilotrun.program()  # pilotrun
with job.stage("load"):  # pilotrun (optional: measures the model's construction)
    model = sums.model()
args = DPOConfig(output_dir="out-dpo", max_steps=12, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                 learning_rate=1e-3, beta=0.1, logging_steps=1, save_steps=6, eval_strategy="steps", eval_steps=6,
                 per_device_eval_batch_size=8, seed=0, max_length=32, bf16=False, report_to=[], use_cpu=True,
                 disable_tqdm=True, dataloader_num_workers=0)
trainer = DPOTrainer(model=model, ref_model=sums.model(), args=args, train_dataset=sums.sums(96, seed=0, preference=True),
                     eval_dataset=sums.sums(16, seed=1, preference=True), processing_class=sums.tokenizer(),
                     callbacks=[PilotrunCallback()])  # pilotrun
trainer.train(resume_from_checkpoint=job.resume_from)  # pilotrun: resume where the pilot asks
if torch.distributed.is_initialized():  # under torchrun: end the group before the interpreter does (hf-trainer's note)
    torch.distributed.destroy_process_group()
