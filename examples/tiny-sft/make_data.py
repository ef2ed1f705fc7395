"""Regenerate the tiny-sft demo data and tokenizer (deterministic; the outputs are committed).

    python examples/tiny-sft/make_data.py

Writes data.jsonl (conversations; one row per assistant turn, grouped by
conversation, the leakage unit) and tokenizer/ (a byte-level BPE trained on it
with the `tokenizers` library).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Egypt": "Cairo",
            "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo", "Chile": "Santiago",
            "Greece": "Athens", "Poland": "Warsaw", "Cuba": "Havana", "Ireland": "Dublin", "India": "New Delhi"}
COLORS = {"grass": "green", "the sky": "blue", "snow": "white", "coal": "black", "a banana": "yellow",
          "a tomato": "red", "an orange": "orange", "a plum": "purple", "chocolate": "brown", "milk": "white"}
WORDS = ["cat", "dog", "sun", "tree", "book", "lamp", "river", "stone", "cloud", "bread", "apple", "train"]
NUMBER = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["add", "capital", "color", "reverse", "minutes", "count"])
    if kind == "add":
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == "capital":
        c = rng.choice(sorted(CAPITALS))
        return f"What is the capital of {c}?", f"The capital of {c} is {CAPITALS[c]}."
    if kind == "color":
        t = rng.choice(sorted(COLORS))
        return f"What color is {t}?", f"{t[0].upper() + t[1:]} is {COLORS[t]}."
    if kind == "reverse":
        w = rng.choice(WORDS)
        return f"Spell {w} backwards.", f"{w} backwards is {w[::-1]}."
    if kind == "minutes":
        h = rng.randint(1, 9)
        return f"How many minutes are in {h} hours?", f"There are {60 * h} minutes in {h} hours."
    w = rng.choice(WORDS)
    return f"How many letters are in the word {w}?", f"The word {w} has {NUMBER[len(w)]} letters."


def conversations(n: int, seed: int = 7) -> list[dict]:
    """No two conversations open with the same question: an identical prompt in train and val
    would be leakage (the split gate warns about it)."""
    rng = random.Random(seed)
    rows = []
    openings: set[str] = set()
    for c in range(n):
        history = ""
        for t in range(rng.randint(1, 3)):
            question, answer = turn(rng)
            if t == 0:
                while question in openings:
                    question, answer = turn(rng)
                openings.add(question)
            prompt = f"{history}User: {question}\nAssistant:"
            rows.append({"id": f"c{c:03d}-t{t}", "group": f"conv-{c:03d}", "prompt": prompt, "response": f" {answer}"})
            history = f"{prompt} {answer}\n"
    return rows


def train_tokenizer(rows: list[dict], folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((r["prompt"] + r["response"] for r in rows), trainer)
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "model_max_length": 256, "clean_up_tokenization_spaces": False}, indent=1) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=1) + "\n")


if __name__ == "__main__":
    rows = conversations(240)
    with open(HERE / "data.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    train_tokenizer(rows, HERE / "tokenizer")
    print(f"{len(rows)} rows in {len({r['group'] for r in rows})} conversations")
