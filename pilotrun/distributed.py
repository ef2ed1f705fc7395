"""Several processes, one job: the process group, each rank's place in it, and the collectives pilotrun uses.

Launched by ``pilotrun launch`` or ``torchrun -m pilotrun run``: one process per device,
``LOCAL_RANK`` picks the device, and the device's backend the process group (gloo on CPU and
NCCL on GPUs: :mod:`pilotrun.backends`). How the model is wrapped and
its gradients reduced is a strategy's business (:mod:`pilotrun.strategies`); this module only
knows processes.
"""
from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import backends
from .errors import LaunchError as LaunchError  # defined there: the CLI catches it without importing torch


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
        rt = backends.for_type(device_type)
        rt.set_device(local_rank)
        import_before_group()
        dist.init_process_group(rt.dist_backend)
    return DistEnv(rank, local_rank, world, strategy)


# torch.distributed.nn.functional declares its collectives with ``group=group.WORLD`` as a default argument, which is
# evaluated when the module is first imported: imported after init_process_group (torch._dynamo imports it, and a
# torch.optim optimizer imports torch._dynamo), it keeps the default group alive after destroy_process_group. The
# group's gloo threads then live into interpreter shutdown, where the last collective's tensor is freed from one of
# them: it takes the GIL of an interpreter being torn down and the process aborts ("terminate called without an
# active exception", exit -6) after it finished its work: 9 of 30 two-rank gloo runs on torch 2.13, 2 loaded cores.
_HOLDS_GROUP = "torch.distributed.nn.functional"


def import_before_group() -> None:
    """Import the module that captures the default group while there is none (its defaults then read None, which
    means the default group when called). Call before ``init_process_group``."""
    import importlib

    importlib.import_module(_HOLDS_GROUP)


def release_destroyed_groups() -> int:
    """Drop the references torch.distributed.nn.functional's default arguments keep to process groups already
    destroyed, so they are freed (and their threads joined) now, not during interpreter shutdown; how many.

    Safe to call at any time: a group still registered is left alone, and a default replaced reads None, the
    default group. Run at exit by a program's handle (a user's program may import torch._dynamo after its
    ``init_process_group``) and by :func:`shutdown`."""
    module = sys.modules.get(_HOLDS_GROUP)
    if module is None or not dist.is_available():
        return 0
    from torch.distributed import distributed_c10d as c10d

    live: set[int] = set()
    if dist.is_initialized():  # some groups still live: leave those (torch's registry of them; private, so guarded)
        registry = getattr(getattr(c10d, "_world", None), "pg_map", None)
        if registry is None:
            return 0
        live = set(map(id, registry))
    released = 0
    for fn in vars(module).values():
        defaults = getattr(fn, "__defaults__", None)
        if not callable(fn) or not defaults:
            continue
        stale = [isinstance(d, dist.ProcessGroup) and id(d) not in live for d in defaults]
        if any(stale):
            fn.__defaults__ = tuple(None if s else d for d, s in zip(defaults, stale))
            released += sum(stale)
    return released


def shutdown(env: DistEnv) -> None:
    """Destroy the process group, after every DDP Reducer is gone.

    A DDP Reducer that holds the group's last reference destroys it with the GIL held, joining gloo
    threads that may need the GIL to free a finished collective's tensors: a deadlock (pytorch#56297),
    seen as a rank that never exits. So the Reducers go first, while the group is still registered
    (callers drop their wrapped models; a DDP module still referenced somewhere loses its Reducer here,
    which only ends its use for training), and the group is destroyed from Python.
    """
    if env.active and dist.is_initialized():
        _close_group()


def _close_group() -> None:
    """Free every DDP Reducer, destroy the process groups from Python, drop torch's stale references to them."""
    _drop_ddp_holds(("logger", "reducer"))  # the C++ Logger holds the Reducer too
    dist.destroy_process_group()
    release_destroyed_groups()


def _drop_ddp_holds(attrs: tuple[str, ...], backend: str | None = None) -> int:
    """Remove ``attrs`` from every DDP module (of a group on ``backend``, when given); how many modules."""
    gc.collect()
    dropped = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance falls back to obj.__class__, and reading any attribute of
        # torch.distributed.reduce_op (one of these objects) prints its deprecation FutureWarning, once per rank.
        if issubclass(type(obj), torch.nn.parallel.DistributedDataParallel):
            group = obj.__dict__.get("process_group")
            if backend is not None and not (isinstance(group, dist.ProcessGroup) and group.name() == backend):
                continue
            for attr in attrs:
                obj.__dict__.pop(attr, None)
            dropped += 1
    gc.collect()
    return dropped


def close_at_exit() -> str | None:
    """At the exit of a program pilotrun runs (its handle's atexit hook): a gloo group the program left initialised
    is closed as :func:`shutdown` closes pilotrun's own, and a destroyed one that torch still holds is freed, so no
    gloo thread outlives the interpreter (the abort above; a group never destroyed aborts the same way, pytorch PR
    179291). Destroying a gloo group is local to the process. An NCCL group is left to torch: its destruction may
    wait on the other ranks. Returns what was done (None: nothing)."""
    if not dist.is_available():
        return None
    if dist.is_initialized() and dist.get_backend() != "gloo":
        return None
    # A DDP model the program still references holds its group (process_group, and its Reducer): after the
    # program's own destroy_process_group too. Its training is over.
    held = _drop_ddp_holds(("logger", "reducer", "process_group"), backend="gloo")
    if dist.is_initialized():
        dist.destroy_process_group()
        release_destroyed_groups()
        return "closed the gloo group the program left initialised"
    released = release_destroyed_groups()
    return "freed a destroyed gloo group torch or a DDP model still held" if held or released else None


# Set by `pilotrun launch` (cli/launch.py): the file where each node's first process writes the run id the ranks
# agreed on, so the launcher of a node that did not create it finds the run's folder and report.
RUN_ID_FILE_VAR = "PILOTRUN_RUN_ID_FILE"


def agree_run_id(env: DistEnv, given: str | None, make: Callable[[], str], config_hash: str | None = None) -> str:
    """One run id for every rank of every node: the one given (``--run-id``), else the one rank 0 makes.

    Two machines started with the same command cannot agree on a fresh id by themselves (clocks, random parts);
    torchrun's rendezvous put them in one process group, so rank 0's id reaches the others through it. Ranks given
    different ids (nodes started with different ``--run-id``) are refused on every rank, naming the ids.
    """
    proposals = gather(env, (env.rank, given, config_hash))
    chosen = broadcast(env, given or make())
    others = sorted({p for _, p, _ in proposals if p is not None and p != chosen})
    configs = {h for _, _, h in proposals}
    if len(configs) > 1:  # a node started with another spec or --set would train another job under this id
        ranks = ", ".join(f"rank {r}: {h}" for r, _, h in proposals)
        shutdown(env)
        raise LaunchError(f"the ranks run different configs ({ranks}): start every node with the same spec file "
                          "and the same --set values")
    if others:
        shutdown(env)  # every rank raises here: the group goes with them, not with a hung collective
        raise LaunchError(f"the nodes were given different --run-id values ({chosen} on rank 0, "
                          f"{', '.join(others)} elsewhere): give every node the same one, or none (rank 0 then "
                          "creates it and the others take it)")
    path = os.environ.get(RUN_ID_FILE_VAR)
    if path and env.local_rank == 0:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:  # the id, and this node's first global rank (whose report the launcher reads)
            f.write(f"{chosen}\n{env.rank}\n")
        os.replace(tmp, path)
    return chosen


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

