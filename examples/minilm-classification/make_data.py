"""Regenerate the MiniLM example's labelled sentences (deterministic; data.jsonl is committed).

    python examples/minilm-classification/make_data.py

Four topics; sentences come in groups of 2-4 that share a source article (the
leakage unit), so no article is split between train and validation.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOPICS = {
    "sports": (["The striker", "The home team", "Our goalkeeper", "The young sprinter", "The coach", "The captain"],
               ["scored twice in the final minutes", "won the championship after extra time", "broke the national record",
                "was injured during the second half", "signed a three year contract", "lost the match on penalties"]),
    "weather": (["Heavy rain", "A cold front", "Strong winds", "The heatwave", "Thick fog", "Light snow"],
                ["is expected across the north tomorrow", "closed several mountain roads", "will bring storms this weekend",
                 "pushed temperatures above forty degrees", "delayed flights at the airport", "should clear by the afternoon"]),
    "food": (["The new bakery", "This soup recipe", "The chef", "Fresh basil", "The street market", "A slow roasted lamb"],
             ["uses only three ingredients", "sells sourdough bread every morning", "won a prize for her dumplings",
              "makes the sauce taste brighter", "offers spicy noodles and grilled fish", "needs four hours in the oven"]),
    "technology": (["The new phone", "The software update", "Our laptop", "The startup", "The chip maker", "The browser"],
                   ["ships with a faster processor", "fixes a serious security bug", "runs for twelve hours on battery",
                    "released an open source database", "announced a smaller transistor", "now blocks tracking cookies"]),
}


WHEN = ["", " this week", " on Monday", " yesterday", " again", " last night"]


def rows(n_articles: int = 72, seed: int = 11) -> list[dict]:
    """No sentence is used twice: an identical text in train and val would be leakage."""
    rng = random.Random(seed)
    out = []
    used: set[str] = set()
    names = sorted(TOPICS)
    for a in range(n_articles):
        topic = names[a % len(names)]
        subjects, predicates = TOPICS[topic]
        for s in range(rng.randint(2, 4)):
            text = ""
            while not text or text in used:
                text = f"{rng.choice(subjects)} {rng.choice(predicates)}{rng.choice(WHEN)}."
            used.add(text)
            out.append({"id": f"a{a:03d}-s{s}", "group": f"article-{a:03d}", "text": text, "label": topic})
    return out


if __name__ == "__main__":
    data = rows()
    with open(HERE / "data.jsonl", "w") as fh:
        for r in data:
            fh.write(json.dumps(r) + "\n")
    print(f"{len(data)} rows in {len({r['group'] for r in data})} articles")
