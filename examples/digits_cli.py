"""The digits model of ``train_digits.py`` driven by a YAML config: the data as a LightningDataModule
(scikit-learn's bundled digits, no download), the rest in ``configs/digits.yaml``.

    cd examples && phalanx fit --config configs/digits.yaml
    cd examples && phalanx fit --config configs/digits.yaml --trainer.max_epochs=3 --trainer.devices=2
    cd examples && phalanx test --config configs/digits.yaml --ckpt_path=runs/cli_digits/.../last.ckpt
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from train_digits import DigitsClassifier, digits_datasets

import phalanx as L

__all__ = ["DigitsDataModule", "DigitsModel"]


class DigitsModel(DigitsClassifier):
    """train_digits.py's classifier, plus test and predict steps for `phalanx test` / `phalanx predict`."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("test_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("test_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(1)


class DigitsDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train_set, self.val_set = digits_datasets(self.hparams.seed)

    def train_dataloader(self) -> Any:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> Any:
        return DataLoader(self.val_set, batch_size=128)

    def test_dataloader(self) -> Any:
        return DataLoader(self.val_set, batch_size=128)

    def predict_dataloader(self) -> Any:
        return DataLoader(self.val_set, batch_size=128)
