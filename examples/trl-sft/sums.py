"""The pieces of the TRL examples: a character-level tokenizer built in code, a small Llama built from a config, and
two-digit additions as prompt/completion (SFT) or prompt/chosen/rejected (DPO) datasets. Nothing is downloaded."""
from __future__ import annotations

import random

import torch
from datasets import Dataset
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SYMBOLS = ["<pad>", "<eos>", "<unk>", *"0123456789+=? "]


def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character."""
    tok = Tokenizer(WordLevel({s: i for i, s in enumerate(SYMBOLS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(SYMBOLS), hidden_size=48, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32, pad_token_id=0, eos_token_id=1, bos_token_id=1))


def sums(n: int, seed: int, preference: bool = False) -> Dataset:
    """``n`` additions; with ``preference`` a wrong sum as the rejected answer. The ``id`` column is what the pilot's
    resume gate would compare (the Trainer drops it: the callback then compares dataset positions)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(50), rng.randrange(50)
        row = {"id": i, "prompt": f"{a}+{b}="}
        if preference:
            row |= {"chosen": f"{a + b}", "rejected": f"{a + b + rng.choice([-10, -1, 1, 10])}"}
        else:
            row["completion"] = f"{a + b}"
        rows.append(row)
    return Dataset.from_list(rows)
