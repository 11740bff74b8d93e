"""The problems of ``bench/lr_finder.py``: a model, its data and how one is fitted or searched.

Every problem builds a fresh module for a learning rate after ``phalanx.seed_everything(seed)``, so a
fit and an LR range test with the same seed start from the same weights and see the batches in the
same order (phalanx's sampler orders them by seed and epoch).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import phalanx
from phalanx.tuner import LRFinderResult, Tuner

GRID = [10 ** (-4 + k / 3) for k in range(13)]
EPOCHS = 3
TRAINER_ARGS: dict[str, Any] = {
    "accelerator": "cpu", "enable_progress_bar": False, "enable_checkpointing": False, "logger": False,
    "num_sanity_val_steps": 0, "enable_model_summary": False,
}


class Supervised(phalanx.Module):
    """A network, a loss and an optimizer class: the shape every problem here shares."""

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


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _split(x: torch.Tensor, y: torch.Tensor, n_train: int) -> tuple[TensorDataset, TensorDataset]:
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def mlp_4class(seed: int) -> Problem:
    """(a) 4 classes drawn by a random teacher network from 10 features; MLP, Adam."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1536, 10, generator=g)
    teacher = torch.randn(10, 16, generator=g), torch.randn(16, 4, generator=g)
    y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(1)
    train, val = _split(x, y, 1024)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        return Supervised(net, nn.functional.cross_entropy, "adam", lr)

    return Problem("(a) 4-class MLP, Adam", make, train, val)


def _digits() -> tuple[TensorDataset, TensorDataset]:
    """The main job's split of sklearn's digits (the seed picks initialisation and order, not the split)."""
    from train_digits import digits_datasets

    return digits_datasets()


def _digits_mlp(optimizer: str) -> Problem:
    train, val = _digits()
    return Problem("", lambda lr: Supervised(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)),
                                             nn.functional.cross_entropy, optimizer, lr), train, val)


def digits_mlp(seed: int) -> Problem:
    """(b) sklearn digits, MLP 64-64-10, Adam."""
    problem = _digits_mlp("adam")
    problem.name = "(b) digits MLP, Adam"
    return problem


def linear_regression(seed: int) -> Problem:
    """(c) y = x.w + b + noise, 16 features with scales from 0.1 to 1; a linear model, plain SGD."""
    g = torch.Generator().manual_seed(seed)
    scales = 10 ** -torch.rand(16, generator=g)
    x = torch.randn(1536, 16, generator=g) * scales
    y = x @ torch.randn(16, 1, generator=g) + torch.randn(1, generator=g) + 0.1 * torch.randn(1536, 1, generator=g)
    train, val = _split(x, y, 1024)
    return Problem("(c) linear regression, SGD", lambda lr: Supervised(nn.Linear(16, 1), nn.functional.mse_loss,
                                                                       "sgd", lr), train, val)


def _tanh_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def tanh_regression(seed: int) -> Problem:
    """(c2) y = sin(x.a) + cos(x.b)/2 + noise from 8 features; tanh MLP 8-32-32-1, plain SGD."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1536, 8, generator=g)
    a, b = torch.randn(8, 1, generator=g) / 2, torch.randn(8, 1, generator=g) / 2
    y = torch.sin(x @ a) + torch.cos(x @ b) / 2 + 0.05 * torch.randn(1536, 1, generator=g)
    train, val = _split(x, y, 1024)
    return Problem("(c2) tanh MLP regression, SGD",
                   lambda lr: Supervised(_tanh_mlp(), nn.functional.mse_loss, "sgd", lr), train, val)


def gpt_lm(seed: int) -> Problem:
    """A GPT-style character LM (examples/fsdp_gpt.py's GPT: 2 layers, width 64, context 32), AdamW, on
    Python's help pages; 1024 training windows drawn by the seed, 128 validation windows from the tail."""
    from pydoc_data.topics import topics

    from fsdp_gpt import GPT

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split, context = int(0.95 * len(data)), 32
    g = torch.Generator().manual_seed(seed)

    def windows(source: torch.Tensor, n: int) -> TensorDataset:
        starts = torch.randint(0, len(source) - context - 1, (n,), generator=g).tolist()
        return TensorDataset(torch.stack([source[s:s + context] for s in starts]),
                             torch.stack([source[s + 1:s + context + 1] for s in starts]))

    train, val = windows(data[:split], 1024), windows(data[split:], 128)
    return Problem("GPT-style char LM, AdamW",
                   lambda lr: Supervised(GPT(len(chars), context, d=64, layers=2, heads=4),
                                         token_cross_entropy, "adamw", lr), train, val)


def main_job(seed: int) -> Problem:
    """The main job: examples/train_digits.py's model (AdamW, dropout, cosine schedule over the fit)."""
    from train_digits import DigitsClassifier

    train, val = _digits()

    def make(lr: float) -> phalanx.Module:
        return DigitsClassifier(lr=lr, epochs=EPOCHS)

    return Problem("main job (train_digits.py)", make, train, val)


PROBLEMS: list[Callable[[int], Problem]] = [mlp_4class, digits_mlp, linear_regression, tanh_regression, gpt_lm,
                                            main_job]


# Variants of PROBLEMS (``--extra``): a rule that does well on PROBLEMS only is fitted to them.
def mlp_4class_batch64(seed: int) -> Problem:
    problem = mlp_4class(seed)
    problem.name, problem.batch_size = "(a) with batch 64", 64
    return problem


def digits_momentum(seed: int) -> Problem:
    problem = _digits_mlp("momentum")
    problem.name = "(b) with SGD, momentum 0.9"
    return problem


def digits_cnn(seed: int) -> Problem:
    """sklearn digits as 8x8 images, two 3x3 convolutions, Adam."""
    train, val = (TensorDataset(d.tensors[0].view(-1, 1, 8, 8), d.tensors[1]) for d in _digits())

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                            nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))
        return Supervised(net, nn.functional.cross_entropy, "adam", lr)

    return Problem("digits CNN, Adam", make, train, val)


def linear_regression_isotropic(seed: int) -> Problem:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1536, 16, generator=g)
    train, val = _split(x, x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(1536, 1, generator=g), 1024)
    return Problem("(c) with features of scale 1", lambda lr: Supervised(nn.Linear(16, 1), nn.functional.mse_loss,
                                                                         "sgd", lr), train, val)


def tanh_regression_momentum(seed: int) -> Problem:
    problem = tanh_regression(seed)
    problem.name = "(c2) with momentum 0.9"
    problem.make = lambda lr: Supervised(_tanh_mlp(), nn.functional.mse_loss, "momentum", lr)
    return problem


def main_job_batch64(seed: int) -> Problem:
    problem = main_job(seed)
    problem.name, problem.batch_size = "main job with batch 64", 64
    return problem


EXTRA: list[Callable[[int], Problem]] = [mlp_4class_batch64, digits_momentum, digits_cnn, linear_regression_isotropic,
                                         tanh_regression_momentum, main_job_batch64]


def _loaders(problem: Problem) -> tuple[DataLoader[Any], DataLoader[Any]]:
    return (DataLoader(problem.train, batch_size=problem.batch_size, shuffle=True),
            DataLoader(problem.val, batch_size=256))


def fit(problem: Problem, seed: int, lr: float) -> float:
    """Validation loss after EPOCHS epochs at ``lr`` from the seed's initialisation and data order."""
    phalanx.seed_everything(seed, verbose=False)
    module = problem.make(lr)
    trainer = phalanx.Trainer(max_epochs=EPOCHS, **TRAINER_ARGS)
    train, val = _loaders(problem)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a diverging learning rate is part of the grid
        try:
            trainer.fit(module, train)
        except FloatingPointError:  # phalanx stops a fit at the first non-finite loss
            return math.inf
        loss = float(trainer.validate(module, val, verbose=False)[0]["val_loss"])
    return loss if math.isfinite(loss) else math.inf


def find(problem: Problem, seed: int, num_training: int) -> LRFinderResult:
    """One LR range test with phalanx's Tuner (defaults but ``num_training``), from the same state as the fits."""
    phalanx.seed_everything(seed, verbose=False)
    module = problem.make(1e-3)
    trainer = phalanx.Trainer(max_epochs=EPOCHS, **TRAINER_ARGS)
    return Tuner(trainer).lr_find(module, train_dataloaders=_loaders(problem)[0], num_training=num_training,
                                  update_attr=False)
