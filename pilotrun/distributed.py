"""Several processes, one job: the process group, each rank's place in it, and the collectives pilotrun uses.

Launched by ``pilotrun launch`` or ``torchrun -m pilotrun run``: one process per device,
``LOCAL_RANK`` picks the device, gloo on CPU and NCCL on GPUs. How the model is wrapped and
its gradients reduced is a strategy's business (:mod:`pilotrun.strategies`); this module only
knows processes.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    strategy: str = "single"  # the strategy's name (pilotrun.strategies) that runs these processes

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class LaunchError(RuntimeError):
    """The processes and the spec disagree (a strategy without processes, processes without a strategy), or the
    launcher's environment variables are not usable."""


def _env_int(name: str, default: int, low: int) -> int:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise LaunchError(f"${name}={text!r} is not an integer >= {low}; torchrun sets it, so unset it when not "
                          "launching several processes (or launch with `pilotrun launch`)")
    return value


def env_from_os() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) otherwise. LaunchError names a bad variable."""
    rank, local_rank, world = _env_int("RANK", 0, 0), _env_int("LOCAL_RANK", 0, 0), _env_int("WORLD_SIZE", 1, 1)
    if rank >= world:
        raise LaunchError(f"$RANK={rank} is not below $WORLD_SIZE={world}: each process's rank is 0..WORLD_SIZE-1")
    return rank, local_rank, world


def init(strategy: str, device_type: str) -> DistEnv:
    """Join torchrun's process group when there is one (``strategy`` is the name recorded for it)."""
    rank, local_rank, world = env_from_os()
    if world == 1:
        return DistEnv(strategy=strategy)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend)
    return DistEnv(rank, local_rank, world, strategy)


def shutdown(env: DistEnv) -> None:
    """Destroy the process group, after every DDP Reducer is gone.

    A DDP Reducer that holds the group's last reference destroys it with the GIL held, joining gloo
    threads that may need the GIL to free a finished collective's tensors: a deadlock (pytorch#56297),
    seen as a rank that never exits. So the Reducers go first, while the group is still registered
    (callers drop their wrapped models; a DDP module still referenced somewhere loses its Reducer here,
    which only ends its use for training), and the group is destroyed from Python.
    """
    if env.active and dist.is_initialized():
        gc.collect()
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance falls back to obj.__class__, and reading any attribute of
            # torch.distributed.reduce_op (one of these objects) prints its deprecation FutureWarning, once per rank.
            if issubclass(type(obj), torch.nn.parallel.DistributedDataParallel):
                for attr in ("logger", "reducer"):  # the C++ Logger holds the Reducer too
                    obj.__dict__.pop(attr, None)
        gc.collect()
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.active:
        dist.barrier()


def all_sum(env: DistEnv, value: float, device: torch.device) -> float:
    if not env.active:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def broadcast(env: DistEnv, obj):
    """Rank 0's object on every rank."""
    if not env.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(env: DistEnv, obj) -> list:
    if not env.active:
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out

