"""The problem families of ``bench/lr_finder.py``, split in two before the rule was chosen.

``TUNING``: the families the suggestion rule was chosen and tuned on (five that issue 33's rule saw,
one of them now with BatchNorm and momentum, and seed 002's script). ``HELD_OUT``: six families
written at the same time, which the rule never saw while it was tuned; their figures are the ones
that say whether it holds out of sample. Between them: Adam, AdamW, plain SGD and SGD with momentum;
classification, regression and two small causal LMs; with and without BatchNorm or dropout; batches
of 16 to 256. Each family draws its data (where it is synthetic), initialisation and order from the
seed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _lr_problems import EPOCHS, Problem, Supervised, optimizer
from _lr_seed002 import Seed002, seed002_data
from torch import nn
from torch.utils.data import TensorDataset

import phalanx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

Family = Callable[[int], Problem]


def _split(x: torch.Tensor, y: torch.Tensor, n_train: int) -> tuple[TensorDataset, TensorDataset]:
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def _standardised(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(0)) / x.std(0)


def _digits() -> tuple[TensorDataset, TensorDataset]:
    """examples/train_digits.py's split of sklearn's digits (the seed picks initialisation and order)."""
    from train_digits import digits_datasets

    return digits_datasets()


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------------------------------------- tuning
def seed002_script(seed: int) -> Problem:
    """Seed 002's script (_lr_seed002.py): the callback, then the fit; Adam, batch 64, torchmetrics."""
    train, val = seed002_data(seed)
    return Problem("seed 002's script, Adam", Seed002, train, val, batch_size=64, callback=True)


def mlp_4class(seed: int) -> Problem:
    """4 classes drawn by a random teacher network from 10 features; MLP, Adam, batch 32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1536, 10, generator=g)
    teacher = torch.randn(10, 16, generator=g), torch.randn(16, 4, generator=g)
    train, val = _split(x, (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(1), 1024)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        return Supervised(net, nn.functional.cross_entropy, "adam", lr)

    return Problem("4-class teacher MLP, Adam", make, train, val)


def linear_regression(seed: int) -> Problem:
    """y = x.w + b + noise, 16 features with scales from 0.1 to 1; a linear model, plain SGD, batch 32."""
    g = torch.Generator().manual_seed(seed)
    scales = 10 ** -torch.rand(16, generator=g)
    x = torch.randn(1536, 16, generator=g) * scales
    y = x @ torch.randn(16, 1, generator=g) + torch.randn(1, generator=g) + 0.1 * torch.randn(1536, 1, generator=g)
    train, val = _split(x, y, 1024)
    return Problem("linear regression, SGD", lambda lr: Supervised(nn.Linear(16, 1), nn.functional.mse_loss,
                                                                   "sgd", lr), train, val)


def tanh_regression_bn(seed: int) -> Problem:
    """y = sin(x.a) + cos(x.b)/2 + noise from 8 features; tanh MLP 8-32-32-1 with BatchNorm, SGD with
    momentum 0.9, batch 128."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, 8, generator=g)
    a, b = torch.randn(8, 1, generator=g) / 2, torch.randn(8, 1, generator=g) / 2
    y = torch.sin(x @ a) + torch.cos(x @ b) / 2 + 0.05 * torch.randn(2048, 1, generator=g)
    train, val = _split(x, y, 1536)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 32), nn.BatchNorm1d(32),
                            nn.Tanh(), nn.Linear(32, 1))
        return Supervised(net, nn.functional.mse_loss, "momentum", lr)

    return Problem("tanh MLP regression + BatchNorm, momentum", make, train, val, batch_size=128)


def gpt_lm(seed: int) -> Problem:
    """A GPT-style character LM (examples/fsdp_gpt.py's GPT: 2 layers, width 64, context 32), AdamW, batch
    32, on Python's help pages; 1024 training windows drawn by the seed, 128 validation windows from the tail."""
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
    """examples/train_digits.py's model (AdamW, dropout, a cosine schedule over the fit), batch 32."""
    from train_digits import DigitsClassifier

    train, val = _digits()
    return Problem("main job (train_digits.py), AdamW + dropout", lambda lr: DigitsClassifier(lr=lr, epochs=EPOCHS),
                   train, val)


# ---------------------------------------------------------------------------------------------- held out
def spirals_dropout(seed: int) -> Problem:
    """Three interleaved spirals in 2-D; MLP 2-128-128-3 with dropout 0.2, SGD with momentum 0.9, batch 16."""
    g = torch.Generator().manual_seed(seed)
    arm = torch.randint(0, 3, (1536,), generator=g)
    r = torch.rand(1536, generator=g)
    angle = 1.5 * math.pi * r + arm * (2 * math.pi / 3) + 0.2 * torch.randn(1536, generator=g)
    x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], 1) * 2
    train, val = _split(x, arm, 1024)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Linear(2, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 128), nn.ReLU(),
                            nn.Dropout(0.2), nn.Linear(128, 3))
        return Supervised(net, nn.functional.cross_entropy, "momentum", lr)

    return Problem("spirals MLP + dropout, momentum", make, train, val, batch_size=16)


class RecurrentLM(phalanx.Module):
    """A one-layer LSTM language model (embedding 32, hidden 64), Adam."""

    def __init__(self, vocab: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(vocab, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, vocab)

    def step_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        hidden, _ = self.lstm(self.embed(x))
        return token_cross_entropy(self.head(hidden), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.step_loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.step_loss(batch))

    def configure_optimizers(self) -> Any:
        return optimizer("adam", self.parameters(), self.lr)


def markov_lstm(seed: int) -> Problem:
    """Sequences of 24 tokens from a random second-order Markov chain over 12 symbols (each pair of symbols
    has 3 likely successors); an LSTM LM, Adam, batch 64; 1024 training and 128 validation sequences."""
    g = torch.Generator().manual_seed(seed)
    vocab, length = 12, 25
    logits = torch.full((vocab, vocab, vocab), -4.0)
    likely = torch.rand(vocab, vocab, vocab, generator=g).argsort(-1)[..., :3]
    logits.scatter_(-1, likely, torch.rand(vocab, vocab, 3, generator=g) * 2)
    probs = logits.softmax(-1)
    seqs = torch.zeros(1152, length, dtype=torch.long)
    seqs[:, :2] = torch.randint(0, vocab, (1152, 2), generator=g)
    for t in range(2, length):
        seqs[:, t] = torch.multinomial(probs[seqs[:, t - 2], seqs[:, t - 1]], 1, generator=g).squeeze(1)
    train, val = _split(seqs[:, :-1], seqs[:, 1:], 1024)
    return Problem("Markov-chain LSTM LM, Adam", lambda lr: RecurrentLM(vocab, lr), train, val, batch_size=64)


def digits_cnn_bn(seed: int) -> Problem:
    """sklearn digits as 8x8 images; two 3x3 convolutions with BatchNorm, AdamW, batch 64."""
    train, val = (TensorDataset(d.tensors[0].view(-1, 1, 8, 8), d.tensors[1]) for d in _digits())

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                            nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))
        return Supervised(net, nn.functional.cross_entropy, "adamw", lr)

    return Problem("digits CNN + BatchNorm, AdamW", make, train, val, batch_size=64)


def _binary_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits.squeeze(1), y)


def tabular_binary(seed: int) -> Problem:
    """Binary labels from a noisy quadratic form of 20 features (4,096 samples, 3,072 to train); MLP
    20-64-1, Adam, batch 256."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 20, generator=g)
    w, q = torch.randn(20, generator=g), torch.randn(20, 20, generator=g) / 20
    score = x @ w / 4 + ((x @ q) * x).sum(1) + 0.5 * torch.randn(4096, generator=g)
    train, val = _split(x, (score > score.median()).float(), 3072)

    def make(lr: float) -> phalanx.Module:
        return Supervised(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1)), _binary_cross_entropy,
                          "adam", lr)

    return Problem("tabular binary MLP, Adam", make, train, val, batch_size=256)


def diabetes_dropout(seed: int) -> Problem:
    """sklearn's diabetes regression (442 patients, 10 features and target standardised, 342 to train);
    MLP 10-64-64-1 with dropout 0.1, SGD with momentum 0.9, batch 16."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    x = _standardised(torch.tensor(data.data, dtype=torch.float32))
    y = _standardised(torch.tensor(data.target, dtype=torch.float32).unsqueeze(1))
    train, val = _split(x, y, 342)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(),
                            nn.Dropout(0.1), nn.Linear(64, 1))
        return Supervised(net, nn.functional.mse_loss, "momentum", lr)

    return Problem("diabetes MLP + dropout, momentum", make, train, val, batch_size=16)


def friedman_bn(seed: int) -> Problem:
    """Friedman's first regression (10 uniform features, 5 of them used; target standardised), 2,048 samples
    (1,536 to train); MLP 10-64-64-1 with BatchNorm, AdamW, batch 128."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(2048, 10, generator=g)
    y = (10 * torch.sin(math.pi * x[:, 0] * x[:, 1]) + 20 * (x[:, 2] - 0.5) ** 2 + 10 * x[:, 3] + 5 * x[:, 4]
         + torch.randn(2048, generator=g))
    train, val = _split(x, _standardised(y.unsqueeze(1)), 1536)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Linear(10, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64),
                            nn.ReLU(), nn.Linear(64, 1))
        return Supervised(net, nn.functional.mse_loss, "adamw", lr)

    return Problem("Friedman regression MLP + BatchNorm, AdamW", make, train, val, batch_size=128)


TUNING: list[Family] = [seed002_script, mlp_4class, linear_regression, tanh_regression_bn, gpt_lm, main_job]
HELD_OUT: list[Family] = [spirals_dropout, markov_lstm, digits_cnn_bn, tabular_binary, diabetes_dropout, friedman_bn]
