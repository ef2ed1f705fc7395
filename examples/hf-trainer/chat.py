"""The pieces of the hf-trainer example: a word-level tokenizer, synthetic chat data and a small GPT-2.

Everything is built in code (no Hub download): a GPT-2-architecture model from a config, a tokenizer from a
word list, and "user asks, assistant answers" arithmetic dialogues of varied length whose labels supervise
the assistant's answer only (the user's turn is -100), as an SFT collator would.
"""
from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

NUMBERS = [str(i) for i in range(20)]
WORDS = ["<pad>", "<unk>", "<eos>", "user:", "assistant:", "what", "is", "plus", "minus", "please", "tell", "me",
         "quickly", "?", "the", "answer", "."] + NUMBERS
IGNORE = -100


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def model(seed: int = 0, model_class=GPT2LMHeadModel, dropout: float = 0.1) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(WORDS), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=2, eos_token_id=2, pad_token_id=0)
    return model_class(config)


def dialogues(n: int, seed: int = 0) -> list[dict]:
    """``n`` chats, each ``{"id", "input_ids", "labels"}``; the user's turn has a random number of polite words,
    so lengths (and supervised counts) vary."""
    rng = random.Random(seed)
    tok = tokenizer()
    out = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        op = rng.choice(["plus", "minus"]) if a >= b else "plus"
        result = a + b if op == "plus" else a - b
        polite = " ".join(rng.choice(["please", "tell", "me", "quickly"]) for _ in range(rng.randrange(4)))
        prompt = f"user: {polite} what is {a} {op} {b} ? assistant:".replace("  ", " ")
        answer = f"the answer is {result} . <eos>" if rng.random() < 0.5 else f"{result} <eos>"
        p, r = tok(prompt)["input_ids"], tok(answer)["input_ids"]
        out.append({"id": i, "input_ids": p + r, "labels": [IGNORE] * len(p) + r})
    return out


class ChatData(torch.utils.data.Dataset):
    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def collate(items: list[dict]) -> dict:
    """Right-pad to the longest chat of the batch; padding is masked and never supervised."""
    width = max(len(it["input_ids"]) for it in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for row, it in enumerate(items):
        n = len(it["input_ids"])
        ids[row, :n] = torch.tensor(it["input_ids"])
        labels[row, :n] = torch.tensor(it["labels"])
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
