"""Models and data shared by the Trainer tests and the multi-process jobs they start (the job
scripts import this module; it holds no tests itself)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx


class CountingSGD(torch.optim.SGD):
    """Counts real ``step()`` calls, whatever wraps it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    def step(self, closure: Any = None) -> Any:
        self.steps += 1
        return super().step(closure)


class Regressor(phalanx.Module):
    """A small float64 MLP, so distributed and single-process runs agree to ~1e-12."""

    def __init__(self, lr: float = 0.05, optimizer: str = "sgd", dropout: float = 0.0, sync_dist: bool = True,
                 scheduler: bool = True) -> None:
        super().__init__()
        torch.manual_seed(1234)  # same initial weights in every process
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1)).double()
        self.lr, self.optimizer_name, self.sync_dist, self.use_scheduler = lr, optimizer, sync_dist, scheduler
        self.counts = {"before_step": 0, "optimizer_step": 0, "scheduler": 0, "train_batches": 0}
        self.opt: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.counts["train_batches"] += 1
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=self.sync_dist, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        err = (self(x) - y).abs()
        self.log("val_mae", err.mean(), sync_dist=True)
        self.log("val_abs_sum", err.sum(), sync_dist=True, reduce_fx="sum")
        self.log("val_max", err.max(), sync_dist=True, reduce_fx="max")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_mae", (self(x) - y).abs().mean(), sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adam":
            self.opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            self.opt = CountingSGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.use_scheduler:
            return self.opt

        def factor(step: int) -> float:
            self.counts["scheduler"] += 1
            return 0.97**step

        sched = torch.optim.lr_scheduler.LambdaLR(self.opt, factor)
        self.counts["scheduler"] = 0  # LambdaLR evaluates once at construction
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.counts["before_step"] += 1

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        self.counts["optimizer_step"] += 1
        optimizer.step(closure=optimizer_closure)


class KillAt:
    """Ends this process at once right after optimizer step ``step`` when ``active`` (exit code 17, no
    cleanup at all, like a preempted node): the kill-and-resume jobs' callback."""

    def __init__(self, step: int, active: bool = True) -> None:
        self.step, self.active = step, active

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.active and trainer.global_step == self.step and not trainer.in_window:
            os._exit(17)


def dataset(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = (x[:, :3].sum(1, keepdim=True) - x[:, 3:].prod(1, keepdim=True)).tanh()
    return TensorDataset(x, y)


def loader(n: int, batch_size: int, shuffle: bool = False, seed: int = 0) -> DataLoader[Any]:
    return DataLoader(dataset(n, seed), batch_size=batch_size, shuffle=shuffle)


def flat(module: nn.Module) -> torch.Tensor:
    """All parameters in one vector (sharded ones gathered first: call it on every rank)."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.parameters()]
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in full])


def quiet(**kwargs: Any) -> dict[str, Any]:
    """Trainer arguments for tests: CPU, no bar, no files unless asked."""
    base = {"accelerator": "cpu", "enable_progress_bar": False, "enable_checkpointing": False, "logger": False,
            "num_sanity_val_steps": 0, "enable_model_summary": False}
    base.update(kwargs)
    return base
