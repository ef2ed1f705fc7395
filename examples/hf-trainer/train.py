"""A transformers Trainer on synthetic chat data — with the lines pilotrun needs (marked ``# pilotrun``).

    python train.py                      # trains normally (the handle is inert)
    pilotrun run pilot.yaml              # pilots it gate by gate
"""
from __future__ import annotations

import sys
from pathlib import Path

from transformers import Trainer, TrainingArguments

import pilotrun
from pilotrun.integrations.transformers import PilotrunCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chat  # noqa: E402

job = pilotrun.program()  # pilotrun

args = TrainingArguments(
    output_dir="out", max_steps=12, per_device_train_batch_size=4, gradient_accumulation_steps=2,
    learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1, save_steps=6,
    eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=8, seed=0,
    report_to=[], dataloader_num_workers=0, use_cpu=True, disable_tqdm=True,
)
with job.stage("load"):  # pilotrun (optional: measures the model's construction)
    model = chat.model()
trainer = Trainer(model=model, args=args, data_collator=chat.collate, processing_class=chat.tokenizer(),
                  train_dataset=chat.ChatData(chat.dialogues(96, seed=0)),
                  eval_dataset=chat.ChatData(chat.dialogues(16, seed=1)),
                  callbacks=[PilotrunCallback()])  # pilotrun
trainer.train(resume_from_checkpoint=job.resume_from)  # pilotrun: resume where the pilot asks
