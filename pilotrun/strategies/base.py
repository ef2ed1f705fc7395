"""What a distribution strategy is: one object that owns everything that changes with it.

A strategy decides how the model is built and wrapped, how many data replicas its processes are
(so model parallelism can say it does not multiply the batch), how gradients are reduced over
micro batches and ranks, the training step itself (backward, gradient clipping, the optimizer
step), the checkpoint layout it writes and reads, how the estimator sizes its memory and
communication, and how its processes hold module buffers (whose copy a checkpoint must keep).
Whether it shards is its own attribute (``shards``). Nothing outside ``pilotrun/strategies/``
tests a strategy's name: callers ask the object (or the registry: ``strategies.sharding()``).

Adding one is a module here and a line in the registry (``strategies/__init__.py``); see
docs/architecture.md.
"""
from __future__ import annotations

import contextlib
import copy
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..checkpoint.dist import full_model_state_dict, restore_distributed, save_distributed, start_distributed
from ..checkpoint.saving import PendingSave, saves_behind
from ..train.loss import plain_backward

if TYPE_CHECKING:
    from ..distributed import DistEnv


def correction(name: str, size: float, counted_in: str, reason: str) -> dict:
    """One named adjustment of an estimate, with its size and why (``counted_in``: allocated, reserved or device)."""
    return {"name": name, "bytes": int(size), "counted_in": counted_in, "reason": reason}


@dataclass(frozen=True)
class StageBytes:
    """One traced stage's peak on one device, by category (the estimator's input to a strategy)."""

    parameters: float
    gradients: float
    optimizer: float
    buffers: float
    activations: float
    weight_casts: float

    @property
    def state(self) -> float:
        """What sharding splits: parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.buffers + self.activations + self.weight_casts


@dataclass(frozen=True)
class BufferSync:
    """How a strategy's processes hold module buffers (BatchNorm running statistics, for example).

    ``source_rank`` is the rank whose buffers every rank adopts at its next forward, so that copy is the
    training state: the checkpoint stores it and every rank's restored buffers must equal it. ``None``:
    each process's buffers are its own and must come back as that process held them. ``why`` is one
    clause for the restore gate's reasons.
    """

    source_rank: int | None
    why: str


class Strategy(ABC):
    """How several processes (or one) share a job."""

    name: ClassVar[str]            # the spec's, the CLI's and the estimator's word for it
    description: ClassVar[str]     # one line for --help and error messages
    multi_process: ClassVar[bool]  # needs a process group of 2 or more
    checkpoint_layout: ClassVar[str]  # what `save` writes (manifest "layout")
    # Parameters, gradients and optimizer state split over the ranks. False: every process keeps a full
    # replica of them. The advisor's sharding fix is the registry's strategy that shards (strategies.sharding()).
    shards: ClassVar[bool] = False
    # Can keep its sharded state (parameters, gradients, optimizer state) in host memory: the spec's
    # distributed.offload (mirrored in config/strategy_names.OFFLOADING). ``offload`` is what this object does:
    # the registry's objects never offload, :meth:`configured` returns one that does.
    offloads: ClassVar[bool] = False
    offload: str = "none"
    # train.precision, for a strategy whose wrap depends on it (FSDP2 gathers in the compute dtype: fsdp.py).
    precision: str = "fp32"

    def configured(self, offload: str = "none", precision: str = "fp32") -> Strategy:
        """This strategy with ``distributed.offload`` and ``train.precision`` applied: itself where they are the
        defaults, else a copy. ValueError where the strategy cannot offload (the spec refuses that combination
        before anything runs)."""
        if offload != "none" and not self.offloads:
            raise ValueError(f"strategy {self.name!r} cannot offload its state to the host (offload {offload!r})")
        if (offload, precision) == (self.offload, self.precision):
            return self
        clone = copy.copy(self)
        clone.offload, clone.precision = offload, precision
        return clone

    def gathered_dtype(self) -> torch.dtype | None:
        """The dtype the wrapped model computes with in place of its stored float parameters (FSDP2's
        MixedPrecisionPolicy); None: it computes with them as stored. The reload check runs the export alike."""
        return None

    # -- data --------------------------------------------------------------------------------
    def data_replicas(self, world_size: int) -> int:
        """Processes that see different examples: they multiply the examples per update."""
        return world_size

    def data_rank(self, rank: int) -> int:
        """Which replica's share of each micro step this rank reads."""
        return rank

    # -- running -----------------------------------------------------------------------------
    @abstractmethod
    def wrap(self, model: torch.nn.Module, env: DistEnv, device: torch.device) -> tuple[torch.nn.Module, str]:
        """The model as this strategy runs it, and a sentence saying how it was wrapped."""

    def reduction_ratio(self, env: DistEnv, device: torch.device) -> float:
        """Measured once: 1.0 when gradient reduction averages over ranks, world_size when it sums."""
        return 1.0

    def micro_batch(self, model: torch.nn.Module, index: int, count: int) -> contextlib.AbstractContextManager:
        """Around micro batch ``index`` of ``count`` in an update window (forward and backward)."""
        return contextlib.nullcontext()

    def buffer_sync(self, model: torch.nn.Module) -> BufferSync:
        """Whose buffers are the state when ranks' copies differ; ``model`` as :meth:`wrap` returned it."""
        return BufferSync(None, "")

    # -- the training step (drivers/loop.py; the overfit gate's copy uses the one-process strategy's) ----------
    def init_context(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Around building the model: where a strategy that initialises shards or on the meta device would act.
        The default builds it as the model builder does."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, scaler: torch.amp.GradScaler | None = None) -> None:
        """Backward of one micro batch's (already normalised) loss; through the fp16 scaler when there is one."""
        plain_backward(loss, scaler)

    def clip_gradients(self, params: Iterable[torch.nn.Parameter], max_norm: float | None,
                       optimizer: torch.optim.Optimizer | None = None,
                       scaler: torch.amp.GradScaler | None = None) -> float | None:
        """Clip the global gradient norm of ``params`` to ``max_norm`` (None: measure only) and return it as it was
        before clipping; None when no parameter has a gradient. With an fp16 ``scaler`` the gradients are unscaled
        first (``optimizer`` is the one they belong to), so the norm and the clip are in true units."""
        if scaler is not None:
            if optimizer is None:
                raise ValueError("unscaling fp16 gradients needs the optimizer that holds them")
            scaler.unscale_(optimizer)
        grads = [p for p in params if p.grad is not None]
        if not grads:
            return None
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm is not None else float("inf"))
        # FSDP2's sharded gradients are DTensors: their norm is one too, and its value is the whole tensor's.
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None) -> bool:
        """Step the optimizer (through the fp16 scaler, which it then updates); True when the scaler skipped the
        step (inf/NaN gradients: it lowered its scale). Refusing a non-finite norm without a scaler is the
        caller's, which knows the update and its examples."""
        if scaler is None:
            optimizer.step()
            return False
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return scaler.get_scale() < scale_before

    # -- state on disk ------------------------------------------------------------------------
    @abstractmethod
    def save(self, folder: Path, driver: Any, config: dict, config_hash: str | None, env: DistEnv) -> dict:
        """Write the driver's full training state; every rank calls it. ``{"files": {...}, "bytes": n,
        "manifest_sha256": hex}`` (the digest of the manifest bytes written: what the ledger records as known)."""

    def start_save(self, folder: Path, driver: Any, config: dict, config_hash: str | None,
                   env: DistEnv) -> PendingSave:
        """:meth:`save`, as a :class:`PendingSave`: what the job waited, and the record once complete. A strategy
        that writes behind the job returns before the write is done; this one writes it all first."""
        started = time.perf_counter()
        return PendingSave.finished(folder, self.save(folder, driver, config, config_hash, env), started)

    @abstractmethod
    def restore(self, driver: Any, folder: Path, env: DistEnv) -> dict:
        """Load a checkpoint this strategy wrote into a freshly built driver; returns the trainer state."""

    def full_state_dict(self, model: torch.nn.Module) -> dict | None:
        """The model's complete weights on every rank's call (rank 0 receives them), or None: the model's own."""
        return None

    # -- estimate ----------------------------------------------------------------------------
    def uses_collectives(self, gpus: int) -> bool:
        """Whether a communicator (NCCL/RCCL buffers) exists on each device."""
        return self.multi_process and gpus > 1

    def compute_replicas(self, gpus: int) -> int:
        """How many devices split the FLOPs of one update."""
        return gpus if self.multi_process else 1

    def optimizer_replicas(self, gpus: int) -> int:
        """How many devices split the optimizer step: each steps its shard when the strategy shards, else every
        device steps every parameter."""
        return gpus if self.shards else 1

    @abstractmethod
    def estimate_memory(self, stage: StageBytes, trace: dict, gpus: int, training: bool) -> tuple[float, list[dict]]:
        """Per-rank bytes of one traced stage's tensors under this strategy, and the corrections that made them."""

    def communication_seconds(self, trace: dict, gpus: int, precision: str, bytes_per_second: float,
                              micro_batches: int = 1) -> float:
        """Seconds per update spent communicating, all of it (overlapped with compute or not), each GPU running
        ``micro_batches`` micro batches in the update."""
        return 0.0

    def exposed_communication(self, total: float, trace: dict, gpus: int, precision: str, bytes_per_second: float,
                              micro_batches: int, compute_seconds: float) -> tuple[float, str]:
        """Of ``total`` (:meth:`communication_seconds`), the seconds the update waits for (not hidden behind its
        ``compute_seconds`` of forward and backward), and the overlap model that says so. The default hides none."""
        return total, "not overlapped with compute (an upper bound)"

    def host_bytes(self, trace: dict, gpus: int) -> float:
        """Bytes one rank keeps in host memory for the training state (:attr:`offload`); 0 when it keeps none."""
        return 0.0

    def offload_seconds(self, trace: dict, gpus: int, precision: str, wire: tuple[float, float], micro_batches: int,
                        compute_seconds: float) -> dict:
        """What keeping the state on the host adds to an update on the GPU side: the copies over the host link, all
        and exposed, with the overlap model (``wire``: (collective, host link) bytes per second). Nothing here."""
        return {"pcie_seconds": 0.0, "exposed_pcie_seconds": 0.0, "model": "no offload"}


class DistributedCheckpoint(Strategy):
    """A multi-process strategy whose state is one torch.distributed.checkpoint (DCP) folder.

    Every rank writes its shard (DDP ranks hold equal replicas; FSDP2 ranks hold their shards) and a
    restore reads it back resharded to the current world size.
    """

    multi_process = True
    checkpoint_layout = "torch.distributed.checkpoint (DCP)"

    def save(self, folder, driver, config, config_hash, env):
        # DCP writes one copy of a tensor every rank holds, from whichever rank balances the write load:
        # where the strategy says one rank's buffers are the state, every rank hands DCP that rank's copy.
        return save_distributed(folder, driver, config, env, config_hash,
                                buffers_from=self.buffer_sync(driver.model).source_rank)

    def start_save(self, folder, driver, config, config_hash, env):
        if saves_behind(driver.device):  # on an accelerator: DCP's async_save, the job waits for the copy
            return start_distributed(folder, driver, config, env, config_hash,
                                     buffers_from=self.buffer_sync(driver.model).source_rank)
        return super().start_save(folder, driver, config, config_hash, env)

    def restore(self, driver, folder, env):
        return restore_distributed(driver, folder, env)

    def full_state_dict(self, model):
        return full_model_state_dict(model)


def probe_reduction(wrapped: torch.nn.Module, probe: torch.nn.Linear, device: torch.device) -> float:
    """Backward through a wrapped 4x4 probe whose single-process gradient is all 2: mean grad / 2."""
    wrapped(torch.ones(2, 4, device=device)).sum().backward()
    grad = probe.weight.grad
    assert grad is not None, "the probe received no gradient"
    full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad  # FSDP2: the DTensor's whole gradient
    return float(full.mean()) / 2.0


def reduction_probe(device: torch.device) -> torch.nn.Linear:
    probe = torch.nn.Linear(4, 4, bias=False).to(device)
    with torch.no_grad():
        probe.weight.fill_(0.5)
    return probe
