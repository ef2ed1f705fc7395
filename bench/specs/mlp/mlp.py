"""An MLP regressor in plain PyTorch, for the estimate-accuracy benchmark."""
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 1)

    def forward(self, x, labels=None):
        y = self.head(self.body(x)).squeeze(-1)
        return {"logits": y, "loss": nn.functional.mse_loss(y, labels)}


def build_model(cfg):
    return MLP(cfg["width"], cfg["depth"])


class Rows(torch.utils.data.Dataset):
    def __init__(self, n, width, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, width, generator=g)
        self.y = self.x[:, :8].sum(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"id": f"r{i}", "x": self.x[i], "y": self.y[i]}


def collate(items):
    return {"x": torch.stack([it["x"] for it in items]), "labels": torch.stack([it["y"] for it in items])}


def build_data(cfg):
    return {"train": Rows(256, cfg["width"], 0), "val": Rows(64, cfg["width"], 1), "collate": collate}
