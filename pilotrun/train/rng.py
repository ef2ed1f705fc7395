"""Seeding every generator a job draws from."""
from __future__ import annotations

import random

import torch


def seed_everything(seed: int) -> None:
    """python, numpy and torch (CPU and every accelerator) from one seed."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)
