"""Several processes, one job: the process group, the device of each rank, and the model wrappers.

Launched by ``pilotrun launch`` or ``torchrun -m pilotrun run``: one process per device,
``LOCAL_RANK`` picks the device, gloo on CPU and NCCL on GPUs. Two strategies, as in
Fabric's ``strategies/``: DDP (a full replica per rank, gradients all-reduced) and FSDP2
(``fully_shard`` on every block of the model's largest ``ModuleList``, then the root).

Gradient reduction is not taken on trust: :func:`reduction_ratio` measures, once, whether the
wrapper averages or sums across ranks on this backend (gloo's AVG has had bugs, pytorch#162338),
and the loss is scaled so that one update equals the single-process update over the same
examples either way.
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
    strategy: str = "none"

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_from_os() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) otherwise."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class LaunchError(RuntimeError):
    """The processes and the spec disagree (a strategy without processes, processes without a strategy)."""


def init(strategy: str, device_type: str) -> DistEnv:
    rank, local_rank, world = env_from_os()
    if world > 1 and strategy == "none":
        raise LaunchError(f"{world} processes were launched but distributed.strategy is 'none': set it to ddp or fsdp")
    if world == 1:
        return DistEnv(strategy="none" if strategy == "none" else strategy)
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
            if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
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


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of the model's largest ModuleList: the unit FSDP2 gathers at once."""
    best: list = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > len(best):
            best = list(mod)
    return best


def wrap(model: torch.nn.Module, env: DistEnv, device: torch.device) -> tuple[torch.nn.Module, str]:
    """The model as the strategy runs it, and a sentence saying how it was wrapped."""
    if not env.active:
        return model, "one process"
    if env.strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return (torch.nn.parallel.DistributedDataParallel(model, device_ids=ids),
                f"DDP over {env.world_size} processes ({dist.get_backend()})")
    from torch.distributed.fsdp import fully_shard

    blocks = _blocks(model)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model, f"FSDP2 over {env.world_size} processes ({dist.get_backend()}): {len(blocks)} blocks and the root sharded"


def reduction_ratio(env: DistEnv, device: torch.device) -> float:
    """Measure what the strategy's gradient reduction does: 1.0 averages over ranks, world_size sums."""
    if not env.active:
        return 1.0
    probe = torch.nn.Linear(4, 4, bias=False).to(device)
    with torch.no_grad():
        probe.weight.fill_(0.5)
    x = torch.ones(2, 4, device=device)
    if env.strategy == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(probe, device_ids=[device.index] if device.type == "cuda" else None)
        wrapped(x).sum().backward()
        grad = probe.weight.grad
    else:
        from torch.distributed.fsdp import fully_shard

        holder = torch.nn.Sequential(probe)
        fully_shard(holder)
        holder(x).sum().backward()
        grad = probe.weight.grad.full_tensor()
    single = 2.0  # d/dW of sum(x @ W.T) with x = ones(2, 4): every entry is 2
    return float(grad.mean()) / single


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
