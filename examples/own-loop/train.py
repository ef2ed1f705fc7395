"""A plain PyTorch loop with its own checkpointing: model, optimizer, scheduler, RNG and data position.

Runs alone (`python train.py`), under torchrun (`torchrun --standalone --nproc-per-node 2 train.py`: gloo DDP on
CPU), and under `pilotrun run pilot.yaml`. The lines marked `# pilotrun` are all that pilotrun needs.
"""
import argparse
import gc
import os
import random

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import pilotrun  # pilotrun

p = argparse.ArgumentParser()
p.add_argument("--updates", type=int, default=40)
p.add_argument("--micro-batch", type=int, default=8)
p.add_argument("--save-every", type=int, default=20)
p.add_argument("--checkpoints", default="checkpoints")
p.add_argument("--resume", default=None, help="a checkpoint file to continue from")
args = p.parse_args()
job = pilotrun.program()  # pilotrun: inert when run without pilotrun

distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

torch.manual_seed(0)  # the same initial weights and dropout stream on every rank
features = torch.randn(512, 16)
targets = features @ torch.randn(16, 1) + 0.1 * torch.randn(512, 1)
train_ids, val_ids = list(range(448)), list(range(448, 512))
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
net = DistributedDataParallel(model) if distributed else model
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min(1.0, (u + 1) / 5) * (1 - u / (args.updates + 1)))
per_epoch = len(train_ids) // (args.micro_batch * world)


def epoch_order(epoch):
    """This rank's examples for one epoch: shuffled with a seed per epoch, so a resumed run rebuilds it."""
    order = list(train_ids)
    random.Random(1000 + epoch).shuffle(order)
    return order[rank::world]


def save(update):
    """Full training state after `update`, written atomically on rank 0."""
    path = os.path.join(job.checkpoint_dir or args.checkpoints, f"update-{update}.pt")  # pilotrun: where to write
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "rng": torch.get_rng_state(), "update": update,
                 "data_position": {"epoch": update // per_epoch, "batch": update % per_epoch}}
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    return path


start = 0
resume = args.resume or job.resume_from  # pilotrun: the checkpoint to resume from
if resume:
    state = torch.load(resume, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    start = state["update"]

for update in range(start + 1, args.updates + 1):
    epoch, batch = divmod(update - 1, per_epoch)
    ids = epoch_order(epoch)[batch * args.micro_batch:(batch + 1) * args.micro_batch]
    with job.stage("first_step" if update == start + 1 else "steady_step", track=[model, opt]):  # pilotrun
        loss = torch.nn.functional.mse_loss(net(features[ids]), targets[ids])
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    job.update(update, loss=loss, lr=lr, grad_norm=grad_norm, ids=ids)  # pilotrun
    if update % args.save_every == 0 or job.should_save(update):  # pilotrun: or where the pilot asks
        with job.stage("save", track=[model, opt]):  # pilotrun
            path = save(update)
            if distributed:
                dist.barrier()  # every rank continues once rank 0's file is complete
        job.saved(update, path)  # pilotrun
    if job.should_stop(update):  # pilotrun
        break

with job.stage("eval", track=[model]), torch.no_grad():  # pilotrun
    model.eval()
    val_loss = torch.nn.functional.mse_loss(model(features[val_ids]), targets[val_ids]).item()
if rank == 0:
    print(f"updates {start + 1}..{update}: final train loss {loss.item():.4f}, val loss {val_loss:.4f}")
if distributed:
    # DDP's Reducer holds the process group; freed at interpreter exit it joins gloo threads that need the GIL and
    # the rank can abort ("terminate called without an active exception", pytorch#56297). Free it first.
    del net
    gc.collect()
    dist.destroy_process_group()
