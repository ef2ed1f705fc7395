"""Deterministic splits by leakage unit: every example of a group lands in one split."""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch.utils.data

from .jsonl import DataError


def group_order(groups: Sequence, seed: int) -> list:
    """Groups sorted by a seeded hash: stable across machines and Python versions."""
    unique = sorted({str(g) for g in groups})
    return sorted(unique, key=lambda g: hashlib.sha256(f"{seed}:{g}".encode()).hexdigest())


def split_by_group(groups: Sequence, fractions: dict[str, float], seed: int) -> dict[str, list[int]]:
    """Indices per split. ``fractions`` maps held-out split names (val, test) to shares of *groups*;
    everything else is train. Each held-out split with a positive share gets at least one group."""
    order = group_order(groups, seed)
    n = len(order)
    assignment: dict[str, str] = {}
    start = 0
    for name, share in fractions.items():
        if share <= 0:
            continue
        count = max(1, math.floor(share * n + 0.5))
        for g in order[start : start + count]:
            assignment[g] = name
        start += count
    if start >= n:
        raise DataError(
            f"{n} group(s) cannot be split into train and {', '.join(fractions)}: "
            "lower the held-out fractions or add groups"
        )
    out: dict[str, list[int]] = {"train": []}
    out.update({name: [] for name in fractions if fractions[name] > 0})
    for i, g in enumerate(groups):
        out[assignment.get(str(g), "train")].append(i)
    return out


class IndexedSubset(torch.utils.data.Dataset):
    """A view of ``base`` at ``indices`` (map-style, items unchanged)."""

    def __init__(self, base, indices: list[int]) -> None:
        self.base = base
        self.indices = list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.base[self.indices[i]]
