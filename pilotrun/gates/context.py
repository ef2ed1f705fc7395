"""What the gates of one pilot share: the spec, this process's place in the job, and what earlier gates produced.

Every field is typed and set either when the pilot starts or by the gate that declares it
produces it (``Gate.produces``); nothing else writes here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..data.audit import ProgressFn, no_progress
from ..drivers import Capability, Driver, JobInputs, JobProcess, ModelDriver, Unsupported, load_inputs
from .products import Product

if TYPE_CHECKING:
    from ..config.spec import Spec
    from ..data.bundle import DataBundle
    from ..distributed import DistEnv
    from ..ledger.store import Ledger
    from ..strategies import Strategy
    from .loop_view import LoopView


@dataclass(frozen=True)
class SavedCheckpoint:
    """Product of ``save``: the checkpoint folder, the live-state fingerprints a restore must reproduce, and the
    sha256 of its manifest (recorded in the ledger: what makes it "known")."""

    folder: Path
    expect: Path           # with several ranks the name holds "{rank}", replaced per rank
    manifest_sha256: str
    # sha256 of each rank's expect file as the save wrote it (rank order): the file lies beside the folder, outside
    # its manifest, so the restore reads it only if these bytes are still there. Empty: a run saved before these
    # were recorded (read unverified, bounded).
    expect_sha256: tuple[str, ...] = ()


@dataclass
class PilotContext:
    spec: Spec
    run_id: str
    out_dir: Path
    process: JobProcess
    ledger: Ledger | None = None
    container_digest: str | None = None
    progress: ProgressFn = no_progress
    restore_from: Path | None = None  # --resume: the checkpoint the driver is restored from right after load
    # --proven-lock: (where it came from, the lock) the lock gate compares with instead of the last run of this name
    proven_lock: tuple[str, dict] | None = None
    # Products (see gates.base.Product): set by the gate that produces each, or by recover() on --resume.
    inputs: JobInputs | None = None         # DATA
    data_error: str | None = None           # why the data could not be built (gates that need it are skipped)
    lock: dict | None = None                # LOCK
    scan: dict | None = None                # SCAN
    driver: Driver | None = None            # DRIVER
    first_update: int | None = None         # FIRST_UPDATE: the step of the first applied update
    checkpoint: SavedCheckpoint | None = None  # CHECKPOINT
    export_dir: Path | None = None          # EXPORT
    export_manifest_sha256: str | None = None  # EXPORT: as the export row recorded it (what makes it "known")

    # -- this process ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.process.device

    @property
    def env(self) -> DistEnv:
        return self.process.env

    @property
    def strategy(self) -> Strategy:
        return self.process.strategy

    @property
    def rank(self) -> int:
        return self.process.env.rank

    @property
    def world_size(self) -> int:
        return self.process.env.world_size

    @property
    def replicas(self) -> int:
        """Data replicas: processes that see different examples (model-parallel ranks do not count)."""
        return self.strategy.data_replicas(self.world_size)

    # -- products ----------------------------------------------------------------------------
    def has(self, product: Product) -> bool:
        return {
            Product.DATA: self.inputs is not None,
            Product.LOCK: self.lock is not None,
            Product.SCAN: self.scan is not None,
            Product.DRIVER: self.driver is not None,
            Product.FIRST_UPDATE: self.first_update is not None,
            Product.CHECKPOINT: self.checkpoint is not None,
            Product.EXPORT: self.export_dir is not None,
        }[product]

    def ensure_data(self) -> DataBundle:
        """Tokenizer and datasets, built once (:func:`pilotrun.drivers.load_inputs`, as every worker builds them).

        A failure is remembered: the gate that hit it fails, later gates that need data are skipped."""
        if self.inputs is None:
            try:
                self.inputs = load_inputs(self.spec)
            except BaseException as exc:  # user factories may raise any BaseException subclass
                self.data_error = f"{type(exc).__name__}: {exc}"
                raise
        return self.inputs.data

    @property
    def data(self) -> DataBundle | None:
        """The datasets when built (``ensure_data`` builds them)."""
        return self.inputs.data if self.inputs is not None else None

    @property
    def tokenizer(self) -> Any:
        return self.inputs.tokenizer if self.inputs is not None else None

    def model_driver(self) -> ModelDriver:
        """The driver, for gates that need the model in this process (``Capability.MODEL``)."""
        if not isinstance(self.driver, ModelDriver):
            name = self.driver.name if self.driver is not None else "no"
            raise Unsupported(f"the {name} driver cannot {Capability.MODEL.missing}")
        return self.driver

    def view(self, **kw: Any) -> LoopView:
        """pilotrun's loop as the model-level checks read it (:class:`pilotrun.gates.view.TrainingView`)."""
        from .loop_view import LoopView

        return LoopView(self, **kw)

    @property
    def model(self) -> torch.nn.Module | None:
        """The plain model (outside any wrapper), when the driver has one."""
        return self.driver.plain_model if isinstance(self.driver, ModelDriver) else None

    # -- places and descriptions ---------------------------------------------------------------
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

    def tracked(self) -> list:
        if not isinstance(self.driver, ModelDriver):
            return []
        return [self.driver.plain_model, self.driver.optimizer]

    def base_inputs(self) -> dict:
        t = self.spec.train
        return {
            "seq_len": self.spec.data.max_length,
            "micro_batch_size": t.micro_batch_size,
            "grad_accum_steps": t.grad_accum_steps,
            "precision": t.precision,
            "device": str(self.device),
            "device_name": self.process.device_name,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    @staticmethod
    def shape_phrase(inputs: dict) -> str:
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
