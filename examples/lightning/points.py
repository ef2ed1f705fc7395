"""The pieces of the Lightning example: a small regression module and its synthetic data.

The module lives in its own importable file (not the script) so that pilotrun's reload_eval can build it in a
fresh process from the exported checkpoint.
"""
from __future__ import annotations

import lightning.pytorch as L
import torch
from torch import nn

DIM = 8


class Regressor(L.LightningModule):
    def __init__(self, dim: int = DIM, hidden: int = 32, lr: float = 1e-2, dropout: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1), batch["y"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1), batch["y"]))

    # Lightning's checkpoint carries no RNG state: without these two hooks a resumed run draws other dropout masks
    # than the uninterrupted one (pilotrun's resume gate shows it as a loss difference at the first resumed update).
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rng_state"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "rng_state" in checkpoint:
            torch.set_rng_state(checkpoint["rng_state"])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Points(torch.utils.data.Dataset):
    """``n`` items ``{"id", "x", "y"}``: y is a fixed random linear function of x plus a little noise."""

    def __init__(self, n: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=gen)
        w = torch.randn(DIM, generator=torch.Generator().manual_seed(1234))
        self.y = self.x @ w + 0.05 * torch.randn(n, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"id": i, "x": self.x[i], "y": self.y[i]}


class EpochSeededSampler(torch.utils.data.Sampler):
    """A shuffle whose order depends only on (seed, epoch): Lightning calls ``set_epoch`` at every epoch start, so a
    run resumed at an epoch boundary draws the same order as the uninterrupted one (a plain ``shuffle=True`` draws
    it from the global RNG, whose state differs after a restart)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


def loader(n: int, seed: int = 0, shuffle: bool = True, batch_size: int = 4) -> torch.utils.data.DataLoader:
    data = Points(n, seed)
    sampler = EpochSeededSampler(n, seed) if shuffle else None
    return torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=0)
