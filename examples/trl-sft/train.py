"""TRL's ``SFTTrainer`` on a ``datasets.Dataset`` of prompt/completion pairs — with the lines pilotrun needs (marked
``# pilotrun``). A Llama-architecture model built from a config (no download) and a character-level tokenizer built
in code learn two-digit additions; the loss is on the completion only (TRL's default for prompt/completion data).

    python train.py                      # trains normally (the handle is inert)
    pilotrun run pilot.yaml              # pilots it gate by gate
    pilotrun select pilot.yaml           # which GPU, for the job this script runs
"""
from __future__ import annotations

import argparse
import random

import torch
from datasets import Dataset
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import pilotrun  # pilotrun
from pilotrun.integrations.transformers import PilotrunCallback  # pilotrun

cli = argparse.ArgumentParser()
cli.add_argument("--learning_rate", type=float, default=3e-3)
cli.add_argument("--seed", type=int, default=0)
cli.add_argument("--max_steps", type=int, default=16)
opts = cli.parse_args()
job = pilotrun.program()  # pilotrun

SYMBOLS = ["<pad>", "<eos>", "<unk>", *"0123456789+=? "]


def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character."""
    tok = Tokenizer(WordLevel({s: i for i, s in enumerate(SYMBOLS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def sums(n: int, seed: int) -> Dataset:
    """``n`` additions as prompt/completion pairs; the ``id`` column is what the pilot's resume gate compares."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(50), rng.randrange(50)
        rows.append({"id": i, "prompt": f"{a}+{b}=", "completion": f"{a + b}"})
    return Dataset.from_list(rows)


torch.manual_seed(opts.seed)
tok = tokenizer()
with job.stage("load"):  # pilotrun (optional: measures the model's construction)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(SYMBOLS), hidden_size=48, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=32, pad_token_id=0, eos_token_id=1, bos_token_id=1))
args = SFTConfig(output_dir="out", max_steps=opts.max_steps, per_device_train_batch_size=8,
                 gradient_accumulation_steps=2, learning_rate=opts.learning_rate, warmup_steps=2, logging_steps=1,
                 save_steps=8, eval_strategy="steps", eval_steps=8, per_device_eval_batch_size=8, seed=opts.seed,
                 max_length=32, bf16=False, report_to=[], use_cpu=True, disable_tqdm=True,
                 dataloader_num_workers=0)
trainer = SFTTrainer(model=model, args=args, train_dataset=sums(128, seed=0), eval_dataset=sums(16, seed=1),
                     processing_class=tok, callbacks=[PilotrunCallback()])  # pilotrun
trainer.train(resume_from_checkpoint=job.resume_from)  # pilotrun: resume where the pilot asks
