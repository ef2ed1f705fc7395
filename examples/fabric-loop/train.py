"""A plain Lightning Fabric loop with its own fabric.save/fabric.load checkpoints — and the lines pilotrun needs
(marked ``# pilotrun``). A GPT-2-architecture model built from a config (no download) learns to copy the first half
of synthetic token sequences into the second.

    python train.py                   # trains normally (the handle is inert)
    pilotrun run pilot.yaml           # pilots it gate by gate
    pilotrun select pilot.yaml        # which GPU, for the job this loop runs
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch
from lightning.fabric import Fabric
from transformers import GPT2Config, GPT2LMHeadModel

import pilotrun  # pilotrun
from pilotrun.integrations.fabric import begin  # pilotrun

cli = argparse.ArgumentParser()
cli.add_argument("--updates", type=int, default=24)
cli.add_argument("--lr", type=float, default=3e-3)
cli.add_argument("--seed", type=int, default=0)
cli.add_argument("--save-every", type=int, default=8)
cli.add_argument("--checkpoints", default="checkpoints")
cli.add_argument("--resume", default=None, help="a checkpoint file written by fabric.save to continue from")
args = cli.parse_args()
job = pilotrun.program()  # pilotrun: inert when run without pilotrun

LENGTH, VOCAB, ACCUM, MICRO = 16, 32, 2, 4


def example(i: int) -> dict:
    """Example ``i``: random tokens then the same tokens again; only the copy is supervised."""
    tokens = torch.randint(3, VOCAB, (LENGTH // 2,), generator=torch.Generator().manual_seed(1000 + i)).tolist()
    return {"id": i, "input_ids": tokens + tokens, "labels": [-100] * (LENGTH // 2) + tokens}


def collate(items: list[dict]) -> dict:
    return {"id": torch.tensor([it["id"] for it in items]),
            "input_ids": torch.tensor([it["input_ids"] for it in items]),
            "labels": torch.tensor([it["labels"] for it in items])}


def loss_of(model, batch):
    """The loop's loss (the probes use it too): the model's own token-mean cross-entropy."""
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


class EpochSampler(torch.utils.data.Sampler):
    """A shuffle that depends only on (seed, epoch): a resumed run rebuilds its epoch's order without drawing from
    torch's global RNG (which the checkpoint restores for dropout)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
torch.manual_seed(args.seed)
train = [example(i) for i in range(96)]
val = [example(10_000 + i) for i in range(16)]
sampler = EpochSampler(len(train), args.seed)
loader = torch.utils.data.DataLoader(train, batch_size=MICRO, sampler=sampler, collate_fn=collate,
                                     generator=torch.Generator().manual_seed(args.seed))
model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                                   bos_token_id=1, eos_token_id=2))
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min(1.0, (u + 1) / 3) * (1 - u / (args.updates + 1)))
model, opt = fabric.setup(model, opt)
loader = fabric.setup_dataloaders(loader)
begin(job, fabric, model, opt, loader, loss=loss_of, accumulate=ACCUM, updates=args.updates,  # pilotrun
      max_grad_norm=1.0, eval_dataset=val)
per_epoch = len(loader) // ACCUM


def evaluate() -> float:
    model.eval()
    with torch.no_grad():
        loss = sum(loss_of(model, fabric.to_device(collate(val[i:i + 8]))).item() for i in range(0, len(val), 8)) / 2
    model.train()
    return loss


start = 0
state = {"model": model, "optimizer": opt, "scheduler": sched, "update": 0, "rng": torch.get_rng_state()}
resume = args.resume or job.resume_from  # pilotrun: the checkpoint to resume from
if resume:
    fabric.load(resume, state)  # model, optimizer and scheduler in place; the update and the RNG (dropout) as saved
    start = state["update"]
    torch.set_rng_state(state["rng"])
update, stop, total = start, False, float("nan")
epoch, done = divmod(start, per_epoch)
while update < args.updates and not stop:
    sampler.set_epoch(epoch)
    batches = itertools.islice(iter(loader), done * ACCUM, None)  # a resumed epoch skips what it already trained
    while update < args.updates:
        micro = list(itertools.islice(batches, ACCUM))
        if len(micro) < ACCUM:
            break
        update += 1
        with job.stage("first_step" if update == start + 1 else "steady_step", track=[model, opt]):  # pilotrun
            total, lr = 0.0, sched.get_last_lr()[0]
            for i, batch in enumerate(micro):
                with fabric.no_backward_sync(model, enabled=i < ACCUM - 1):
                    loss = loss_of(model, batch)
                    fabric.backward(loss / ACCUM)
                    total += loss.item() / ACCUM
            grad_norm = fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        ids = [i for b in micro for i in b["id"].tolist()]
        job.update(update, loss=total, lr=lr, grad_norm=float(grad_norm), ids=ids)  # pilotrun
        if update % 8 == 0:
            with job.stage("eval", track=[model]):  # pilotrun
                val_loss = evaluate()
            job.evaluated(update, val_loss)  # pilotrun
        if update % args.save_every == 0 or job.should_save(update):  # pilotrun: or where the pilot asks
            path = os.path.join(job.checkpoint_dir or args.checkpoints, f"update-{update}.ckpt")  # pilotrun: where
            with job.stage("save", track=[model, opt]):  # pilotrun
                state.update(update=update, rng=torch.get_rng_state())
                fabric.save(path, state)
            job.saved(update, path)  # pilotrun
        if job.should_stop(update):  # pilotrun
            stop = True
            break
    epoch, done = epoch + 1, 0
fabric.print(f"updates {start + 1}..{update}: final train loss {total:.4f}")
