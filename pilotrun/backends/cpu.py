"""The host: always there, never an accelerator; its memory is measured by the live-tensor tracker and RSS."""
from __future__ import annotations

from .base import Backend


class CPU(Backend):
    name = "cpu"
    label = "CPU"
    device_type = "cpu"
    accelerator = False

    def available(self) -> bool:
        return True

    # The host's generator ("torch_cpu" in a checkpoint) is every process's, whatever its accelerator:
    # checkpoint/state.py keeps it beside the accelerator's streams, so it is not this backend's rng_state.
