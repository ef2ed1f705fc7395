"""A transformers Trainer on synthetic chat data — with the lines pilotrun needs (marked ``# pilotrun``).

    python train.py                      # trains normally (the handle is inert)
    python train.py --learning_rate 3e-3 --seed 1
    pilotrun run pilot.yaml              # pilots it gate by gate
    pilotrun select pilot.yaml           # which GPU, for the job this script runs
    pilotrun campaign ../campaign/trainer-lr.yaml   # 3 learning rates x 2 seeds of this script
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

import pilotrun
from pilotrun.integrations.transformers import PilotrunCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chat  # noqa: E402

job = pilotrun.program()  # pilotrun

cli = argparse.ArgumentParser()
cli.add_argument("--learning_rate", type=float, default=1e-3)
cli.add_argument("--seed", type=int, default=0)
cli.add_argument("--max_steps", type=int, default=12)
opts = cli.parse_args()
args = TrainingArguments(
    output_dir="out", max_steps=opts.max_steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
    learning_rate=opts.learning_rate, lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1, save_steps=6,
    eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=8, seed=opts.seed,
    report_to=[], dataloader_num_workers=0, use_cpu=True, disable_tqdm=True,
)
with job.stage("load"):  # pilotrun (optional: measures the model's construction)
    model = chat.model(seed=opts.seed)
trainer = Trainer(model=model, args=args, data_collator=chat.collate, processing_class=chat.tokenizer(),
                  train_dataset=chat.ChatData(chat.dialogues(96, seed=0)),
                  eval_dataset=chat.ChatData(chat.dialogues(16, seed=1)),
                  callbacks=[PilotrunCallback()])  # pilotrun
trainer.train(resume_from_checkpoint=job.resume_from)  # pilotrun: resume where the pilot asks
# Under torchrun, end the process group before the interpreter does, as PyTorch advises: the Trainer leaves it open, and
# gloo's threads torn down with the interpreter can abort a finished run at exit (SIGABRT, "terminate called without
# an active exception": rank 1 of a pilot's control run did so once in the test suite, 2026-12-02).
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
