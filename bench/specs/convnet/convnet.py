"""A small convolutional classifier on random images, for the estimate-accuracy benchmark."""
import torch
from torch import nn


class ConvNet(nn.Module):
    def __init__(self, channels: int, classes: int):
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1, stride=2), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.Conv2d(2 * c, 4 * c, 3, padding=1, stride=2), nn.BatchNorm2d(4 * c), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(4 * c, classes)

    def forward(self, pixels, labels=None):
        logits = self.head(self.features(pixels))
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}


def build_model(cfg):
    return ConvNet(cfg["channels"], cfg["classes"])


class Images(torch.utils.data.Dataset):
    def __init__(self, n, size, classes, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, size, size, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"id": f"img{i}", "pixels": self.x[i], "label": int(self.y[i])}


def collate(items):
    return {"pixels": torch.stack([it["pixels"] for it in items]),
            "labels": torch.tensor([it["label"] for it in items])}


def build_data(cfg):
    return {"train": Images(128, cfg["size"], cfg["classes"], 0), "val": Images(32, cfg["size"], cfg["classes"], 1),
            "collate": collate, "label_names": [f"c{i}" for i in range(cfg["classes"])]}
