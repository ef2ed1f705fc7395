"""State shared by the gates of one pilot: the spec, the device, and what earlier gates built."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config.spec import Spec
from ..data.audit import ProgressFn, no_progress
from ..data.bundle import DataBundle, build_data
from ..models.loading import LoadedModel, load_tokenizer


@dataclass
class PilotContext:
    spec: Spec
    run_id: str
    out_dir: Path
    device: torch.device
    device_reason: str
    ledger: Any = None
    container_digest: str | None = None
    rank: int = 0
    world_size: int = 1
    device_name: str = "cpu"                  # e.g. "NVIDIA H100 80GB HBM3": estimates calibrate by it
    env: Any = None                           # pilotrun.distributed.DistEnv
    progress: ProgressFn = no_progress
    # Filled in by gates as they pass.
    tokenizer: Any = None
    data: DataBundle | None = None
    loaded: LoadedModel | None = None
    trainer: Any = None
    lock: dict | None = None
    resume_checkpoint: Path | None = None     # --resume: restore the trainer from this after load
    checkpoint_dir: Path | None = None
    checkpoint_expect: Path | None = None     # fingerprints of the live state at save time
    checkpoint_manifest: str | None = None    # sha256 of the checkpoint's manifest (recorded in the ledger)
    export_dir: Path | None = None
    records: dict[str, list] = field(default_factory=dict)
    data_error: str | None = None       # why the data could not be built (gates that need it are skipped)
    scan: dict | None = None            # the inspect gate's counts over the training split

    @property
    def model(self) -> torch.nn.Module | None:
        return self.loaded.model if self.loaded is not None else None

    def ensure_data(self) -> DataBundle:
        """Tokenizer and datasets, built once (built-in tasks need the tokenizer first).

        A failure is remembered: the gate that hit it fails, later gates that need data are skipped."""
        if self.data is None:
            try:
                if self.spec.data.task is not None and self.tokenizer is None:
                    self.tokenizer = load_tokenizer(self.spec)
                self.data = build_data(self.spec, self.tokenizer)
            except (Exception, SystemExit) as exc:
                self.data_error = f"{type(exc).__name__}: {exc}"
                raise
        return self.data

    def worker_dir(self) -> Path:
        """Where child processes write their logs and results (created on demand)."""
        folder = self.out_dir / "workers"
        folder.mkdir(exist_ok=True)
        return folder

    def spec_file(self) -> Path:
        from ..workers.common import write_spec_file

        path = self.worker_dir() / "spec.json"
        if not path.exists():
            write_spec_file(self.spec, path)
        return path

    def plain_model_copy(self) -> torch.nn.Module:
        """A copy of the model outside any distributed wrapper, for checks that run on one rank alone.
        One process: a deep copy of the trained model. Several: the model rebuilt from the spec (same seed)."""
        import copy

        if self.env is None or not self.env.active:
            return copy.deepcopy(self.model)
        from ..models.loading import build_model

        return build_model(self.spec, self.data.label_names, self.tokenizer).model.to(self.device)

    def tracked(self) -> list:
        objs: list = []
        if self.model is not None:
            objs.append(self.model)
        if self.trainer is not None:
            objs.append(self.trainer.optimizer)
        return objs

    def base_inputs(self) -> dict:
        t = self.spec.train
        return {
            "seq_len": self.spec.data.max_length,
            "micro_batch_size": t.micro_batch_size,
            "grad_accum_steps": t.grad_accum_steps,
            "precision": t.precision,
            "device": str(self.device),
            "device_name": self.device_name,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def shape_phrase(self, gate: str, inputs: dict) -> str:
        """'length 4096, batch 8, bf16': the input that matters when a gate fails."""
        length = inputs.get("seq_len")
        batch = inputs.get("batch_size", inputs.get("micro_batch_size"))
        parts = []
        if length:
            parts.append(f"length {length}")
        if batch:
            parts.append(f"batch {batch}")
        if inputs.get("precision"):
            parts.append(str(inputs["precision"]))
        return ", ".join(parts) if parts else "its inputs"
