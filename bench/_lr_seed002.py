"""Seed 002's script, as its user ran it: the ``LearningRateFinder`` callback, then ``fit``.

An MLP 32-128-4 with Adam at lr 1e-3; 2,048 samples of 32 Gaussian features, labelled
``(x[:, :4].sum(1) > 0) + 2 * (x[:, 4:8].sum(1) > 0)``; the first 1,536 train in shuffled batches of 64,
the other 512 validate; 3 epochs; torchmetrics ``Accuracy`` logged next to the loss, every value with
``sync_dist=True``. ``bench/lr_finder.py`` runs it as one of its problems and
``tests/tuner/test_seed_script.py`` asserts that its suggestion trains within 3x of a grid's best.
"""

from __future__ import annotations

from typing import Any

import torch
import torchmetrics
from torch import nn
from torch.utils.data import TensorDataset

import phalanx


class Seed002(phalanx.Module):
    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr  # the LearningRateFinder sets it
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_acc", self.train_acc, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def seed002_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The 1,536 training and 512 validation samples (the seed draws them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return TensorDataset(x[:1536], y[:1536]), TensorDataset(x[1536:], y[1536:])
