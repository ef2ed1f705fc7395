"""The shape of a model that strategies and the estimator care about: its repeated blocks."""
from __future__ import annotations

import torch


def repeated_blocks(model: torch.nn.Module) -> tuple[str, list[torch.nn.Module]]:
    """The name and children of the model's longest ``ModuleList``: its repeated layers.

    FSDP2 shards each of them as one unit (gathered at once for compute), and the estimator
    sizes the unsharded layer in flight from the largest of them. ``("", [])`` when there is none.
    """
    best_name, best = "", list[torch.nn.Module]()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > len(best):
            best_name, best = name, list(mod)
    return best_name, best


def largest_block(model: torch.nn.Module) -> tuple[str, int, int]:
    """(name, parameter bytes, count) of the largest repeated block; the whole model when nothing repeats."""
    name, blocks = repeated_blocks(model)
    if len(blocks) > 1:
        sizes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
        i = max(range(len(blocks)), key=lambda k: sizes[k])
        return f"{name}.{i}", sizes[i], len(blocks)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return "(whole model)", total, 0
