"""Apple's Metal Performance Shaders: one device, no memory counters pilotrun reads, gloo between processes."""
from __future__ import annotations

import torch

from .base import Backend, Visible


class MPS(Backend):
    name = "mps"
    label = "MPS"
    device_type = "mps"
    oom_words = ("mps",)

    def available(self) -> bool:
        mps = getattr(torch.backends, "mps", None)
        return mps is not None and mps.is_available()

    def visible(self) -> Visible:
        return Visible(names=("Apple MPS",))

    def unavailable(self, requested: str) -> str:
        return "train.device is 'mps' but MPS is not available here (use cpu or auto)"

    def synchronize(self, device: torch.device) -> None:
        torch.mps.synchronize()

    # Its random stream (torch.mps.get_rng_state) is not in checkpoints: none written so far has it, and a resume
    # on MPS is compared within rtol, not bitwise.
