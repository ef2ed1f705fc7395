"""Built-in tasks on JSONL: causal-LM fine-tuning and sequence classification.

causal-lm rows: ``{"id", "group", "prompt", "response"}``. The model sees
``[bos] prompt response [eos]``; labels are ``-100`` on ``[bos]`` and every prompt
token, so only the response (and its end) is learned. Truncation keeps the start.

seq-classification rows: ``{"id", "group", "text", "label"}``; ``label`` is a class
name (string) or index (integer). Class names are kept and passed to the model as
``id2label``.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.utils.data

from .jsonl import DataError

IGNORE = -100


def _batch_ids(tokenizer, texts: list[str], **kw) -> list[list[int]]:
    """Tokenize in batches (the fast tokenizers run these in Rust, in parallel)."""
    out: list[list[int]] = []
    for start in range(0, len(texts), 1024):
        out.extend(list(ids) for ids in tokenizer(texts[start : start + 1024], **kw)["input_ids"])
    return out


class CausalLMDataset(torch.utils.data.Dataset):
    """Tokenized once, up front, so the training loop never waits on the tokenizer."""

    def __init__(self, rows: list[dict], tokenizer, max_length: int) -> None:
        self.rows = rows
        self.max_length = max_length
        prompts = _batch_ids(tokenizer, [str(r["prompt"]) for r in rows], add_special_tokens=False)
        responses = _batch_ids(tokenizer, [str(r["response"]) for r in rows], add_special_tokens=False)
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.items = []
        for row, prompt, response in zip(rows, prompts, responses):
            response = response + eos
            input_ids = head + prompt + response
            labels = [IGNORE] * (len(head) + len(prompt)) + response
            self.items.append({
                "id": str(row["id"]),
                "group": str(row["group"]),
                "input_ids": input_ids[:max_length],
                "labels": labels[:max_length],
                "prompt_len": min(len(head) + len(prompt), max_length),
            })

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    def fingerprint(self, i: int) -> str:
        """The input (the prompt) for the identical-inputs audit, independent of truncation."""
        return hashlib.sha1(str(self.rows[i]["prompt"]).encode()).hexdigest()


class ClassificationDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict], tokenizer, max_length: int, label_index: dict[str, int]) -> None:
        self.rows = rows
        self.max_length = max_length
        ids = _batch_ids(tokenizer, [str(r["text"]) for r in rows], truncation=True, max_length=max_length)
        self.items = [
            {"id": str(r["id"]), "group": str(r["group"]), "input_ids": x, "label": label_index[str(r["label"])]}
            for r, x in zip(rows, ids)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    def fingerprint(self, i: int) -> str:
        return hashlib.sha1(str(self.rows[i]["text"]).encode()).hexdigest()


class PadCollate:
    """Pads to the longest item (or to ``pad_to`` when set: the eval gate's worst case)."""

    def __init__(self, pad_id: int, classification: bool, pad_to: int | None = None) -> None:
        self.pad_id = pad_id
        self.classification = classification
        self.pad_to = pad_to

    def pad_batch(self, batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
        """Right-pad a collated batch to ``length``: the worst-case shape of the long run."""
        cur = batch["input_ids"].shape[1]
        if cur >= length:
            return batch
        extra = length - cur
        fill = {"input_ids": self.pad_id, "attention_mask": 0, "labels": IGNORE}
        out = {}
        for key, t in batch.items():
            if t.ndim == 2 and t.shape[1] == cur and key in fill:
                out[key] = torch.nn.functional.pad(t, (0, extra), value=fill[key])
            else:
                out[key] = t
        return out

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(it["input_ids"]) for it in items)
        length = max(longest, self.pad_to or 0)
        n = len(items)
        input_ids = torch.full((n, length), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, length), dtype=torch.long)
        batch: dict[str, torch.Tensor] = {}
        if not self.classification:
            labels = torch.full((n, length), IGNORE, dtype=torch.long)
        for r, it in enumerate(items):
            k = len(it["input_ids"])
            input_ids[r, :k] = torch.tensor(it["input_ids"], dtype=torch.long)
            attention[r, :k] = 1
            if not self.classification:
                labels[r, :k] = torch.tensor(it["labels"], dtype=torch.long)
        batch["input_ids"] = input_ids
        batch["attention_mask"] = attention
        batch["labels"] = (
            torch.tensor([it["label"] for it in items], dtype=torch.long) if self.classification else labels
        )
        return batch


def class_names(rows_by_split: dict[str, list[dict]], declared: list[str] | None) -> list[str]:
    """Class index → name. Declared names win; otherwise sorted names, or 0..max for integer labels."""
    values = [row["label"] for rows in rows_by_split.values() for row in rows]
    if declared:
        known = set(declared) | {str(i) for i in range(len(declared))}
        bad = sorted({str(v) for v in values} - known)
        if bad:
            raise DataError(f"labels {bad[:5]} are not in data.labels {declared}; add them or fix the data")
        return list(declared)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise DataError("integer labels must be 0 or more")
        return [str(i) for i in range(max(values) + 1)]
    if any(not isinstance(v, str) for v in values):
        raise DataError("labels mix names and numbers; use one kind, or declare data.labels")
    return sorted(set(values))


def label_index(names: list[str], rows_by_split: dict[str, list[dict]]) -> dict[str, Any]:
    index = {name: i for i, name in enumerate(names)}
    # Integer labels (or their string form) address the index directly.
    for rows in rows_by_split.values():
        for row in rows:
            v = row["label"]
            if isinstance(v, int) and not isinstance(v, bool):
                index.setdefault(str(v), v)
    return index
