"""Modules with torchmetrics metrics, shared by tests/integration/test_metrics.py and the jobs it starts (the job
scripts import this module; it holds no tests itself)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection, SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassRecall

import phalanx


def data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()  # 3 classes, learnable
    return TensorDataset(x, y)


def loader(n: int, batch_size: int, shuffle: bool = False, seed: int = 0) -> DataLoader[Any]:
    return DataLoader(data(n, seed), batch_size=batch_size, shuffle=shuffle)


class Classifier(phalanx.Module):
    """A small classifier with a train and a validation accuracy.

    ``style="manual"`` updates the metric in training_step and logs ``compute()`` as a tensor at epoch
    end (works with any phalanx); ``style="object"`` logs the Metric objects themselves (the Lightning
    idiom, on_step and on_epoch), plus a MetricCollection with log_dict in validation.
    It also keeps plain attributes its step changes: a sample counter and a list of batch sizes.
    """

    def __init__(self, style: str = "object", lr: float = 0.05, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(1234)
        # float64: 2-rank and single-process runs agree to ~1e-12, so accuracies agree exactly.
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3)).double()
        self.style, self.lr = style, lr
        self.train_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.val_metrics = MetricCollection(
            {"recall": MulticlassRecall(num_classes=3), "f1": MulticlassF1Score(num_classes=3)},
            prefix="val_",
        )
        self.train_seen = SumMetric()  # samples of the epoch: a resume that lost metric state shows here
        self.val_seen = SumMetric()  # synced by torchmetrics; a second (phalanx) sum would double it
        self.samples_seen = 0
        self.batch_sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.samples_seen += len(x)
        self.batch_sizes.append(len(x))
        ones = torch.ones(len(x), dtype=torch.float64)
        if self.style == "manual":
            self.train_acc.update(logits, y)
            self.train_seen.update(ones)
        else:
            self.train_acc(logits, y)
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True, prog_bar=True)
            self.train_seen(ones)
            self.log("train_seen", self.train_seen, on_step=False, on_epoch=True)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        if self.style == "manual":
            self.log("train_acc", self.train_acc.compute())
            self.log("train_seen", self.train_seen.compute())
            self.train_acc.reset()
            self.train_seen.reset()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        if self.style == "manual":
            self.val_acc.update(logits, y)
        else:
            self.val_acc(logits, y)
            self.log("val_acc", self.val_acc, sync_dist=True)  # sync_dist must not reduce a second time
            self.val_metrics(logits, y)
            self.log_dict(self.val_metrics)
            self.val_seen(torch.ones(len(x), dtype=torch.float64))
            self.log("val_seen", self.val_seen, sync_dist=True, reduce_fx="sum")

    def on_validation_epoch_end(self) -> None:
        if self.style == "manual":
            self.log("val_acc", self.val_acc.compute())
            self.val_acc.reset()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def metric_report(trainer: Any, model: Classifier) -> dict[str, Any]:
    """JSON-able view of what a fit left behind."""
    return {
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "update_count": int(model.train_acc._update_count),
        "samples_seen": model.samples_seen,
        "n_batches": len(model.batch_sizes),
        "state_devices": sorted({str(getattr(model.train_acc, s).device) for s in model.train_acc._defaults}),
        "device": str(trainer.device),
    }
