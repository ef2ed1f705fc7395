"""TRL's ``SFTTrainer`` on a ``datasets.Dataset`` of prompt/completion pairs — with the lines pilotrun needs (marked
``# pilotrun``). A Llama-architecture model built from a config (no download) and a character-level tokenizer built
in code learn two-digit additions; the loss is on the completion only (TRL's default for prompt/completion data).

    python train.py                      # trains normally (the handle is inert)
    pilotrun run pilot.yaml              # pilots it gate by gate
    pilotrun select pilot.yaml           # which GPU, for the job this script runs
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from trl import SFTConfig, SFTTrainer

import pilotrun  # pilotrun
from pilotrun.integrations.transformers import PilotrunCallback  # pilotrun

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sums  # noqa: E402

cli = argparse.ArgumentParser()
cli.add_argument("--learning_rate", type=float, default=3e-3)
cli.add_argument("--seed", type=int, default=0)
cli.add_argument("--max_steps", type=int, default=16)
opts = cli.parse_args()
job = pilotrun.program()  # pilotrun

with job.stage("load"):  # pilotrun (optional: measures the model's construction)
    model = sums.model(seed=opts.seed)
args = SFTConfig(output_dir="out", max_steps=opts.max_steps, per_device_train_batch_size=8,
                 gradient_accumulation_steps=2, learning_rate=opts.learning_rate, warmup_steps=2, logging_steps=1,
                 save_steps=8, eval_strategy="steps", eval_steps=8, per_device_eval_batch_size=8, seed=opts.seed,
                 max_length=32, bf16=False, report_to=[], use_cpu=True, disable_tqdm=True,
                 dataloader_num_workers=0)
trainer = SFTTrainer(model=model, args=args, train_dataset=sums.sums(128, seed=0),
                     eval_dataset=sums.sums(16, seed=1), processing_class=sums.tokenizer(),
                     callbacks=[PilotrunCallback()])  # pilotrun
trainer.train(resume_from_checkpoint=job.resume_from)  # pilotrun: resume where the pilot asks
if torch.distributed.is_initialized():  # under torchrun: end the group before the interpreter does (hf-trainer's note)
    torch.distributed.destroy_process_group()
