"""A trainer, fabric and strategy faked down to what callbacks call (tests/callbacks/test_callbacks.py and
tests/checkpoint/test_checkpoint_layer.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class FakeStrategy:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def weights_finite(self, module: Any) -> bool:
        return True

    def remove_checkpoint(self, path: Any) -> None:
        if self.rank == 0:
            Path(path).unlink(missing_ok=True)


class FakeFabric:
    def __init__(self, rank: int = 0) -> None:
        self.logged: list[tuple[dict[str, float], int | None]] = []
        self.strategy = FakeStrategy(rank)

    def log_dict(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((dict(metrics), step))

    def remove_checkpoint(self, path: Any) -> None:
        self.strategy.remove_checkpoint(path)


class FakeTrainer:
    def __init__(self, tmp: Path, rank: int = 0) -> None:
        self.global_step, self.current_epoch, self.batches_done = 0, 0, 0
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.is_global_zero, self.global_rank, self.in_window, self.should_stop = rank == 0, rank, False, False
        self.log_dir, self.loggers, self.fabric, self.model = tmp, [object()], FakeFabric(rank), None
        self.saved: list[str] = []
        self.log_every_n_steps, self.num_training_batches, self.num_eval_batches = 1, 5, [3]
        self.stage = "fit"
        self.optimizer: Any = None
        self.printed: list[str] = []

    def save_checkpoint(self, path: Any, weights_only: bool = False) -> None:
        self.saved.append(Path(path).name)
        if self.is_global_zero:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text("x")

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.printed.append(" ".join(map(str, args)))


def end_epoch(cb: Any, trainer: FakeTrainer, metric: float | None = None, name: str = "val_loss") -> None:
    """End a training epoch of 2 steps for the callback ``cb``, with the monitored ``name`` at ``metric``."""
    if metric is not None:
        trainer.callback_metrics[name] = torch.tensor(metric)
    trainer.global_step += 2
    cb.on_train_epoch_end(trainer, None)
    trainer.current_epoch += 1
