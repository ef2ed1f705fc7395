"""One process, one device: the model as built, a single-process checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint.io import MANIFEST, CheckpointError
from ..checkpoint.saving import save_checkpoint, saves_behind, start_checkpoint
from ..checkpoint.state import restore_training_state
from .base import StageBytes, Strategy


class Single(Strategy):
    name = "single"
    description = "one process on one device"
    multi_process = False
    checkpoint_layout = "single process"

    def data_replicas(self, world_size: int) -> int:
        return 1

    def data_rank(self, rank: int) -> int:
        return 0

    def wrap(self, model, env, device):
        return model, "one process"

    def save(self, folder, driver, config, config_hash, env):
        record = save_checkpoint(folder, driver, config, config_hash)
        return {"files": record.files, "bytes": record.total_bytes, "manifest_sha256": record.manifest_sha256}

    def start_save(self, folder, driver, config, config_hash, env):
        if saves_behind(driver.device):
            return start_checkpoint(folder, driver, config, config_hash)
        return super().start_save(folder, driver, config, config_hash, env)

    def restore(self, driver, folder, env):
        layout = _layout(folder)
        if layout == "dcp":
            written = json.loads((Path(folder) / MANIFEST).read_text()).get("world_size")
            raise CheckpointError(f"{folder} was written by {written} processes, this job has 1: convert it "
                                  "(pilotrun convert) and load the single file instead")
        return restore_training_state(driver, folder)

    def estimate_memory(self, stage: StageBytes, trace: dict, gpus: int, training: bool):
        return stage.total, []


def _layout(folder: Path) -> str | None:
    try:
        return json.loads((Path(folder) / MANIFEST).read_text()).get("layout")
    except (OSError, ValueError):
        return None

