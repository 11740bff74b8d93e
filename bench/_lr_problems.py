"""How ``bench/lr_finder.py`` fits and searches a problem (the problems themselves: ``_lr_families.py``).

Every problem builds a fresh module for a learning rate after ``phalanx.seed_everything(seed)``, so a
fit and an LR range test with the same seed start from the same weights and see the batches in the
same order (phalanx's sampler orders them by seed and epoch).
"""

from __future__ import annotations

import atexit
import math
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import phalanx
from phalanx.callbacks import LearningRateFinder
from phalanx.tuner import LRFinderResult, Tuner

GRID = [10 ** (-4 + k / 3) for k in range(13)]
# Every problem's module is built with this learning rate for the search, so it is the one a run keeps where
# the finder gives none: Tuner.lr_find leaves it, and LearningRateFinder's fit trains at it. On the grid.
KEPT_LR = 1e-3
EPOCHS = 3
# A fit claims its folder for as long as it runs: two benches started in one folder would refuse each other.
ROOT = tempfile.mkdtemp(prefix="phalanx-lr-bench-")
atexit.register(shutil.rmtree, ROOT, True)
TRAINER_ARGS: dict[str, Any] = {
    "accelerator": "cpu", "enable_progress_bar": False, "enable_checkpointing": False, "logger": False,
    "num_sanity_val_steps": 0, "enable_model_summary": False,
    "default_root_dir": ROOT,
}


class Supervised(phalanx.Module):
    """A network, a loss and an optimizer: the shape most problems share."""

    def __init__(self, net: nn.Module, loss: Callable[..., torch.Tensor], optimizer: str, lr: float) -> None:
        """``optimizer``: "adam", "adamw" (weight decay 0.01), "sgd" or "momentum" (SGD, momentum 0.9)."""
        super().__init__()
        self.net, self.loss, self.optimizer_name, self.lr = net, loss, optimizer, lr

    def step_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return self.loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.step_loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.step_loss(batch))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9 if self.optimizer_name == "momentum" else 0)


@dataclass
class Problem:
    name: str
    make: Callable[[float], phalanx.Module]  # a fresh module with this learning rate (after seeding)
    train: Dataset[Any]
    val: Dataset[Any]
    batch_size: int = 32
    # The search runs as a user's script runs it: the LearningRateFinder callback, then the fit at its
    # suggestion (validated every epoch), instead of Tuner.lr_find before a fit of its own.
    callback: bool = False


@dataclass
class Search:
    """One LR range test: its result and, where the problem searches with the callback, the validation
    loss of the fit that followed it (at the suggestion; None when there was none)."""

    result: LRFinderResult
    fit_loss: float | None = None


@dataclass
class Fit:
    """A 3-epoch fit: its validation loss (``inf`` when it diverged) and its steps' training losses."""

    val_loss: float
    train_losses: list[float] = field(default_factory=list)


class _StepLosses(phalanx.callbacks.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def loaders(problem: Problem) -> tuple[DataLoader[Any], DataLoader[Any]]:
    return (DataLoader(problem.train, batch_size=problem.batch_size, shuffle=True),
            DataLoader(problem.val, batch_size=256))


def _val_loss(trainer: phalanx.Trainer, module: phalanx.Module, val: DataLoader[Any]) -> float:
    loss = float(trainer.validate(module, val, verbose=False)[0]["val_loss"])
    return loss if math.isfinite(loss) else math.inf


def fit(problem: Problem, seed: int, lr: float, record: bool = False) -> Fit:
    """Validation loss after EPOCHS epochs at ``lr`` from the seed's initialisation and data order;
    with ``record``, each step's training loss too."""
    phalanx.seed_everything(seed, verbose=False)
    module = problem.make(lr)
    steps = _StepLosses()
    trainer = phalanx.Trainer(max_epochs=EPOCHS, callbacks=[steps] if record else [], **TRAINER_ARGS)
    train, val = loaders(problem)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a diverging learning rate is part of the grid
        try:
            trainer.fit(module, train)
        except FloatingPointError:  # phalanx stops a fit at the first non-finite loss
            return Fit(math.inf, steps.losses)
        return Fit(_val_loss(trainer, module, val), steps.losses)


def initial_loss(problem: Problem, seed: int) -> float:
    """The validation loss of the seed's initialisation, before any training."""
    phalanx.seed_everything(seed, verbose=False)
    module = problem.make(KEPT_LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _val_loss(phalanx.Trainer(**TRAINER_ARGS), module, loaders(problem)[1])


def find(problem: Problem, seed: int, num_training: int) -> Search:
    """One LR range test from the same state as the fits, its arguments the defaults but ``num_training``:
    ``Tuner.lr_find``, or the ``LearningRateFinder`` callback and the fit after it (``problem.callback``)."""
    phalanx.seed_everything(seed, verbose=False)
    module = problem.make(KEPT_LR)
    train, val = loaders(problem)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a refusal is counted; its message is for users
        if not problem.callback:
            trainer = phalanx.Trainer(max_epochs=EPOCHS, **TRAINER_ARGS)
            return Search(Tuner(trainer).lr_find(module, train_dataloaders=train, num_training=num_training,
                                                 update_attr=False))
        finder = LearningRateFinder(num_training_steps=num_training)
        trainer = phalanx.Trainer(max_epochs=EPOCHS, callbacks=[finder], **TRAINER_ARGS)
        try:
            trainer.fit(module, train, val)
            loss = float(trainer.callback_metrics["val_loss"])
        except FloatingPointError:
            loss = math.inf
    assert finder.optimal_lr is not None
    return Search(finder.optimal_lr, (loss if math.isfinite(loss) else math.inf) if finder.lr is not None else None)
