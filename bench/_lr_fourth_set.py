"""The fourth set of LR-finder problem families, ``FOURTH_SET`` (12): written on 2026-11-28, after the second
set (``_lr_second_set.py``) had been scored and before any further change of the suggestion rule; scored
once as the held-out half (85 % within the bar), then used to choose the next change, so it counts as
tuning now (``bench/lr_finder.py``). Only plain fits on
a learning-rate grid were run on them while they were written (to check that each trains, that its best loss
is well above 0 and its best learning rate inside the grid, and that a fit is cheap); never the LR finder.

None repeats an earlier family's data, model and optimizer. Between them: Adam (2), AdamW (3), plain SGD
(2), SGD with momentum 0.9 (2), SGD with Nesterov momentum 0.9 (2) and Adagrad (1); binary and multi-class
classification, regression (squared error and a Gaussian likelihood with a learned spread), matrix
factorisation, and four sequence models (a residual 1-D CNN, a transformer encoder, a GRU on the adding
problem and a dilated causal convolutional LM); with and without BatchNorm, LayerNorm, GroupNorm or
dropout; residual connections in four; batches of 8 to 512. Data are scikit-learn's generators or drawn by
a ``torch.Generator``, all from the seed; every one has label or target noise (or real ambiguity), so the
best validation loss stays well above 0. Validation sets hold at least 256 samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from _lr_families import Family, _mlp, _split, _standardised, token_cross_entropy
from _lr_problems import Problem, Supervised
from _lr_second_set import _binary_cross_entropy, _tensor
from torch import nn

import phalanx


class NesterovSupervised(Supervised):
    """:class:`Supervised` with SGD and Nesterov momentum 0.9, which no other family uses."""

    def __init__(self, net: nn.Module, loss: Callable[..., torch.Tensor], lr: float) -> None:
        super().__init__(net, loss, "nesterov", lr)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, nesterov=True)


class AdagradSupervised(Supervised):
    """:class:`Supervised` with Adagrad, the usual optimizer of sparse embedding models."""

    def __init__(self, net: nn.Module, loss: Callable[..., torch.Tensor], lr: float) -> None:
        super().__init__(net, loss, "adagrad", lr)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adagrad(self.parameters(), lr=self.lr)


def _flip(y: torch.Tensor, classes: int, fraction: float, g: torch.Generator) -> torch.Tensor:
    """``y`` with ``fraction`` of its labels replaced by uniformly drawn ones (label noise)."""
    noisy = torch.rand(len(y), generator=g) < fraction
    return torch.where(noisy, torch.randint(0, classes, y.shape, generator=g), y)


# ---------------------------------------------------------------------------------------------- classification
def xor_blobs(seed: int) -> Problem:
    """Four overlapping Gaussian blobs at (+-1, +-1), labelled by XOR of the signs (640 points to train, 384 to
    validate); MLP 2-32-32-1, binary cross-entropy, plain SGD, batch 8."""
    g = torch.Generator().manual_seed(seed)
    corner = torch.randint(0, 2, (1024, 2), generator=g)
    x = (2 * corner - 1).float() + 0.6 * torch.randn(1024, 2, generator=g)
    train, val = _split(x, (corner[:, 0] ^ corner[:, 1]).float(), 640)

    def make(lr: float) -> phalanx.Module:
        return Supervised(_mlp(2, 32, 32, 1), _binary_cross_entropy, "sgd", lr)

    return Problem("XOR blobs MLP, SGD", make, train, val, batch_size=8)


class _Residual(nn.Module):
    """A stem, residual blocks (each adds its output to its input), then a head."""

    def __init__(self, stem: nn.Module, blocks: list[nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.stem, self.blocks, self.head = stem, nn.ModuleList(blocks), head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        out: torch.Tensor = self.head(h)
        return out


class _ResidualMLP(_Residual):
    """A linear stem, ``blocks`` pre-LayerNorm residual blocks (LayerNorm, ReLU, Linear), then LayerNorm and a head."""

    def __init__(self, features: int, width: int, out: int, blocks: int = 2) -> None:
        super().__init__(nn.Linear(features, width),
                         [nn.Sequential(nn.LayerNorm(width), nn.ReLU(), nn.Linear(width, width))
                          for _ in range(blocks)],
                         nn.Sequential(nn.LayerNorm(width), nn.Linear(width, out)))


def quantiles_residual(seed: int) -> Problem:
    """sklearn's Gaussian quantiles: 3 classes as nested shells of 6 Gaussian features, 10 % of labels redrawn
    (2,048 samples, 1,536 to train); residual MLP of width 64 with LayerNorm, Nesterov momentum, batch 32."""
    from sklearn.datasets import make_gaussian_quantiles

    x, y = make_gaussian_quantiles(n_samples=2048, n_features=6, n_classes=3, random_state=seed)
    labels = _flip(_tensor(y, torch.long), 3, 0.1, torch.Generator().manual_seed(seed))
    train, val = _split(_tensor(x), labels, 1536)
    return Problem("Gaussian quantiles residual MLP + LayerNorm, Nesterov",
                   lambda lr: NesterovSupervised(_ResidualMLP(6, 64, 3), nn.functional.cross_entropy, lr), train, val)


def hastie_bn(seed: int) -> Problem:
    """sklearn's Hastie 10.2 problem (10 Gaussian features, positive where their squares sum above 9.34), 5 % of
    labels flipped (3,072 samples, 2,560 to train); MLP 10-128-128-1 with BatchNorm and dropout 0.2, AdamW,
    batch 128."""
    from sklearn.datasets import make_hastie_10_2

    x, y = make_hastie_10_2(n_samples=3072, random_state=seed)
    labels = _flip(_tensor(y > 0, torch.long), 2, 0.1, torch.Generator().manual_seed(seed))
    train, val = _split(_tensor(x), labels.float(), 2560)

    def make(lr: float) -> phalanx.Module:
        net = _mlp(10, 128, 128, 1, norm=nn.BatchNorm1d, dropout=0.2)
        return Supervised(net, _binary_cross_entropy, "adamw", lr)

    return Problem("Hastie 10.2 MLP + BatchNorm + dropout, AdamW", make, train, val, batch_size=128)


def anisotropic_mixture_bn(seed: int) -> Problem:
    """5 Gaussian classes in 8-D sharing one random elongated covariance, means close enough to overlap (2,560
    samples, 2,048 to train); MLP 8-64-64-5 with BatchNorm, SGD with momentum 0.9, batch 256."""
    g = torch.Generator().manual_seed(seed)
    means, mixing = 0.5 * torch.randn(5, 8, generator=g), torch.randn(8, 8, generator=g) / math.sqrt(8)
    label = torch.randint(0, 5, (2560,), generator=g)
    x = means[label] + torch.randn(2560, 8, generator=g) @ (mixing * torch.linspace(1.0, 2.0, 8))
    train, val = _split(_standardised(x), label, 2048)

    def make(lr: float) -> phalanx.Module:
        return Supervised(_mlp(8, 64, 64, 5, norm=nn.BatchNorm1d), nn.functional.cross_entropy, "momentum", lr)

    return Problem("anisotropic mixture MLP + BatchNorm, momentum", make, train, val, batch_size=256)


# ---------------------------------------------------------------------------------------------- regression
def _gaussian_nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # The whole negative log-likelihood, log(2 pi)/2 included, so that it stays positive for the spreads drawn.
    mean, log_sd = out[:, :1], out[:, 1:]
    return (log_sd + 0.5 * ((y - mean) / log_sd.exp()) ** 2 + 0.5 * math.log(2 * math.pi)).mean()


def heteroscedastic(seed: int) -> Problem:
    """y = sin(x.a) + x.b/2 + noise whose spread (0.5 to 1.5) depends on x.c, from 4 Gaussian features (2,048
    samples, 1,536 to train); MLP 4-64-64-2 giving the mean and log-spread, Gaussian negative log-likelihood,
    AdamW, batch 64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, 4, generator=g)
    a, b, c = (torch.randn(4, 1, generator=g) / 2 for _ in range(3))
    spread = 0.5 + torch.sigmoid(2 * x @ c)
    train, val = _split(x, torch.sin(x @ a) + x @ b / 2 + spread * torch.randn(2048, 1, generator=g), 1536)

    def make(lr: float) -> phalanx.Module:
        return Supervised(_mlp(4, 64, 64, 2), _gaussian_nll, "adamw", lr)

    return Problem("heteroscedastic Gaussian-likelihood MLP, AdamW", make, train, val, batch_size=64)


def swiss_roll(seed: int) -> Problem:
    """sklearn's Swiss roll with noise 1.0: the position along the roll (standardised) regressed from the noisy
    3-D point (standardised; 1,536 samples, 1,024 to train); SiLU MLP 3-64-64-1, plain SGD, batch 16."""
    from sklearn.datasets import make_swiss_roll

    x, t = make_swiss_roll(1536, noise=1.0, random_state=seed)
    train, val = _split(_standardised(_tensor(x)), _standardised(_tensor(t).unsqueeze(1)), 1024)

    def make(lr: float) -> phalanx.Module:
        return Supervised(_mlp(3, 64, 64, 1, act=nn.SiLU), nn.functional.mse_loss, "sgd", lr)

    return Problem("Swiss roll SiLU MLP regression, SGD", make, train, val, batch_size=16)


def friedman2_dropout(seed: int) -> Problem:
    """sklearn's second Friedman problem (4 features and the target standardised, plus noise of 0.3 of its
    spread; 3,072 samples, 2,560 to train); MLP 4-128-128-1 with dropout 0.2, Adam, batch 512."""
    from sklearn.datasets import make_friedman2

    x, y = make_friedman2(3072, random_state=seed)
    target = _standardised(_tensor(y).unsqueeze(1))
    target = target + 0.3 * torch.randn(target.shape, generator=torch.Generator().manual_seed(seed))
    train, val = _split(_standardised(_tensor(x)), target, 2560)

    def make(lr: float) -> phalanx.Module:
        return Supervised(_mlp(4, 128, 128, 1, dropout=0.2), nn.functional.mse_loss, "adam", lr)

    return Problem("Friedman 2 regression MLP + dropout, Adam", make, train, val, batch_size=512)


class _Factorisation(nn.Module):
    """Ratings as user . item + user bias + item bias + a global offset, from (user, item) index pairs."""

    def __init__(self, users: int, items: int, rank: int = 8) -> None:
        super().__init__()
        self.user, self.item = nn.Embedding(users, rank), nn.Embedding(items, rank)
        self.user_bias, self.item_bias = nn.Embedding(users, 1), nn.Embedding(items, 1)
        self.offset = nn.Parameter(torch.zeros(1))
        # Small factors, so that the first predictions are near the offset rather than of spread sqrt(rank).
        for table in (self.user, self.item, self.user_bias, self.item_bias):
            nn.init.normal_(table.weight, std=0.1)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        u, i = pairs[:, 0], pairs[:, 1]
        out: torch.Tensor = ((self.user(u) * self.item(i)).sum(1, keepdim=True) + self.user_bias(u)
                             + self.item_bias(i) + self.offset)
        return out


def ratings_adagrad(seed: int) -> Problem:
    """Ratings of 150 items by 200 users from rank-4 factors and biases plus noise of spread 0.5 (3,072 observed
    pairs, 2,560 to train); a rank-8 matrix factorisation with biases, Adagrad, batch 256."""
    g = torch.Generator().manual_seed(seed)
    users, items, n = 200, 150, 3072
    u_factors, i_factors = torch.randn(users, 4, generator=g) / 2, torch.randn(items, 4, generator=g) / 2
    pairs = torch.stack([torch.randint(0, users, (n,), generator=g), torch.randint(0, items, (n,), generator=g)], 1)
    u, i = pairs[:, 0], pairs[:, 1]
    rating = ((u_factors[u] * i_factors[i]).sum(1) + 0.5 * torch.randn(users, generator=g)[u]
              + 0.5 * torch.randn(items, generator=g)[i] + 3 + 0.5 * torch.randn(n, generator=g))
    train, val = _split(pairs, rating.unsqueeze(1), 2560)
    return Problem("rating matrix factorisation, Adagrad",
                   lambda lr: AdagradSupervised(_Factorisation(users, items), nn.functional.mse_loss, lr), train, val,
                   batch_size=256)


# ---------------------------------------------------------------------------------------------- sequences
class _MotifCNN(_Residual):
    """A 1-D CNN over one-hot sequences: a stem, two residual blocks (GroupNorm, ReLU, convolution), average
    pooling over positions and a linear head."""

    def __init__(self, channels: int, width: int, classes: int) -> None:
        super().__init__(nn.Conv1d(channels, width, 5, padding=2),
                         [nn.Sequential(nn.GroupNorm(4, width), nn.ReLU(), nn.Conv1d(width, width, 3, padding=1))
                          for _ in range(2)],
                         nn.Sequential(nn.GroupNorm(4, width), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                                       nn.Linear(width, classes)))


def motif_count_cnn(seed: int) -> Problem:
    """One-hot sequences of 48 letters from 4 carrying a random 5-letter motif 0 to 3 times (the class), each
    planted letter mutated with probability 0.1 (2,048 sequences, 1,536 to train); residual 1-D CNN of width 32
    with GroupNorm, SGD with momentum 0.9, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, k = 2048, 48, 5
    motif = torch.randint(0, 4, (k,), generator=g)
    seqs = torch.randint(0, 4, (n, length), generator=g)
    count = torch.randint(0, 4, (n,), generator=g)
    for row in range(n):
        # Non-overlapping slots of 12 letters, so that the planted copies never overwrite each other.
        for slot in torch.randperm(4, generator=g)[: int(count[row])].tolist():
            start = 12 * slot + int(torch.randint(0, 12 - k + 1, (1,), generator=g))
            mutated = torch.where(torch.rand(k, generator=g) < 0.1, torch.randint(0, 4, (k,), generator=g), motif)
            seqs[row, start:start + k] = mutated
    x = nn.functional.one_hot(seqs, 4).float().transpose(1, 2)
    train, val = _split(x, count, 1536)
    return Problem("motif-count residual 1-D CNN + GroupNorm, momentum",
                   lambda lr: Supervised(_MotifCNN(4, 32, 4), nn.functional.cross_entropy, "momentum", lr),
                   train, val)


class _MajorityEncoder(nn.Module):
    """A two-block post-LayerNorm transformer encoder (width 32, 4 heads, dropout 0.1), mean-pooled, classified."""

    def __init__(self, vocab: int, classes: int, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(self.embed(x)).mean(1))
        return out


def majority_transformer(seed: int) -> Problem:
    """Sequences of 24 tokens from 6 (tokens 3 to 5 are filler), labelled by which of tokens 0 to 2 occurs most
    (ties to the lowest), 10 % of labels redrawn (2,048 sequences, 1,536 to train); a two-block transformer
    encoder, AdamW, batch 128."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 6, (2048, 24), generator=g)
    counts = nn.functional.one_hot(tokens, 6)[..., :3].sum(1)
    labels = _flip(counts.argmax(1), 3, 0.1, g)
    train, val = _split(tokens, labels, 1536)
    return Problem("majority-token transformer encoder, AdamW",
                   lambda lr: Supervised(_MajorityEncoder(6, 3), nn.functional.cross_entropy, "adamw", lr),
                   train, val, batch_size=128)


class _LastState(nn.Module):
    """A GRU over (value, marker) pairs, regressing from its last hidden state."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.rnn = nn.GRU(2, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, last = self.rnn(x)
        out: torch.Tensor = self.head(last[-1])
        return out


def adding_gru(seed: int) -> Problem:
    """The adding problem: 30 uniform values, two of them marked, the target their sum (standardised) plus noise
    of spread 0.3 (1,280 sequences, 1,024 to train); a GRU of 32 units, Adam, batch 16."""
    g = torch.Generator().manual_seed(seed)
    n, length = 1280, 30
    values = torch.rand(n, length, generator=g)
    marked = torch.rand(n, length, generator=g).argsort(1)[:, :2]
    markers = torch.zeros(n, length).scatter_(1, marked, 1.0)
    target = ((values * markers).sum(1, keepdim=True) - 1) / math.sqrt(1 / 6) + 0.3 * torch.randn(n, 1, generator=g)
    train, val = _split(torch.stack([values, markers], 2), target, 1024)
    return Problem("adding-problem GRU, Adam", lambda lr: Supervised(_LastState(), nn.functional.mse_loss, "adam", lr),
                   train, val, batch_size=16)


def _expression(g: torch.Generator, depth: int = 0) -> str:
    """An arithmetic expression from a small probabilistic grammar: a digit, a bracketed expression or two joined
    by an operator, less likely to branch the deeper it is."""
    r = float(torch.rand(1, generator=g))
    if depth > 3 or r < 0.4:
        return str(int(torch.randint(0, 10, (1,), generator=g)))
    if r < 0.55:
        return "(" + _expression(g, depth + 1) + ")"
    op = "+-*"[int(torch.randint(0, 3, (1,), generator=g))]
    return _expression(g, depth + 1) + op + _expression(g, depth + 1)


class _CausalConvLM(nn.Module):
    """Embedding 32, three residual causal convolutions (kernel 3, dilations 1, 2, 4, GELU), a linear head."""

    def __init__(self, vocab: int, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.dilations = (1, 2, 4)
        self.convs = nn.ModuleList(nn.Conv1d(d, d, 3, dilation=k) for k in self.dilations)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).transpose(1, 2)
        for dilation, conv in zip(self.dilations, self.convs, strict=True):
            # Left padding only, so that position t sees nothing after t.
            h = h + nn.functional.gelu(conv(nn.functional.pad(h, (2 * dilation, 0))))
        out: torch.Tensor = self.head(h.transpose(1, 2))
        return out


def expression_conv_lm(seed: int) -> Problem:
    """Arithmetic expressions from a small grammar, ';'-separated into one stream, cut into windows of 32
    characters (1,024 to train, 256 to validate, from separate stretches); a dilated causal CNN LM, SGD with
    Nesterov momentum 0.9, batch 32."""
    g = torch.Generator().manual_seed(seed)
    vocab = "0123456789+-*();"
    text = ""
    while len(text) < 33 * 1280:
        text += _expression(g) + ";"
    stream = torch.tensor([vocab.index(c) for c in text[:33 * 1280]]).view(1280, 33)
    train, val = _split(stream[:, :-1], stream[:, 1:], 1024)
    return Problem("expression-grammar causal CNN LM, Nesterov",
                   lambda lr: NesterovSupervised(_CausalConvLM(len(vocab)), token_cross_entropy, lr), train, val)


FOURTH_SET: list[Family] = [xor_blobs, quantiles_residual, hastie_bn, anisotropic_mixture_bn, heteroscedastic,
                             swiss_roll, friedman2_dropout, ratings_adagrad, motif_count_cnn, majority_transformer,
                             adding_gru, expression_conv_lm]
