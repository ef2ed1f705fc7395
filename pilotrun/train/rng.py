"""Seeding every generator a job draws from."""
from __future__ import annotations

import random

import torch

# torch.Generator.manual_seed accepts 0..2**64-1 (negative values down to -2**63); numpy.random.seed 0..2**32-1.
TORCH_SEED_SPACE = 2**64


def derived_seed(value: int) -> int:
    """A seed computed from spec.seed (spec.seed * 1_000_003 + epoch, ...), folded into torch's range. Values that
    were already in range are unchanged, so the data order of any run that worked before stays the same."""
    return value % TORCH_SEED_SPACE


def seed_everything(seed: int) -> None:
    """python, numpy and torch (CPU and every accelerator) from one seed."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)
