"""The fifth set of LR-finder problem families, ``HELD_OUT`` (12): the held-out half of issue 41's second stop, in
the tuning half since the sixth set's score chose a change (docs/trainer.md, "The suggestion"); written on
2026-11-28/29, after the fourth set had been scored, by someone who never ran the LR finder on them nor saw its
results; the rule's last change was chosen on the tuning families alone (it was committed while these were being
written). Only plain fits on a learning-rate grid were run on them while they were written (to check that each
trains, that its best loss is well above 0 and its best learning rate inside the grid, and that a fit is cheap);
never the LR finder.

None repeats an earlier family's data, model and optimizer. Between them: Adam (2), AdamW (3), plain SGD (2),
SGD with momentum 0.9 (2), NAdam (1), Adamax (1) and RAdam (1); binary and multi-class classification (a
pair-matching task among them), regression (squared error, a pinball loss over three quantiles, and a
classification and a regression head trained together), a denoiser, two small CNNs on synthetic images, a
permutation-invariant set model, and two recurrent sequence models (a bidirectional GRU tagger and an LSTM
sentiment classifier); with and without BatchNorm, LayerNorm, GroupNorm or dropout; residual connections in
one; 2 to 6 layers deep; batches of 8 to 512. Data are drawn by a ``torch.Generator`` or by scikit-learn's
generators, all from the seed; every one has label or target noise (or real ambiguity), so the best validation
loss stays well above 0. Validation sets hold at least 256 samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _lr_families import Family, _mlp, _split, _standardised, token_cross_entropy
from _lr_fourth_set import _flip
from _lr_problems import Problem, Supervised
from _lr_second_set import _binary_cross_entropy, _tensor
from torch import nn

import phalanx


class OptimizerSupervised(Supervised):
    """:class:`Supervised` with any torch optimizer (NAdam, Adamax, RAdam here) at its defaults but the learning
    rate."""

    def __init__(self, net: nn.Module, loss: Callable[..., torch.Tensor], optimizer: Callable[..., Any],
                 lr: float) -> None:
        super().__init__(net, loss, getattr(optimizer, "__name__", "custom").lower(), lr)
        self.optimizer_class = optimizer

    def configure_optimizers(self) -> Any:
        return self.optimizer_class(self.parameters(), lr=self.lr)


# ---------------------------------------------------------------------------------------------- images
def _grid(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column coordinates of a ``size`` x ``size`` image, shaped to broadcast against (n, 1, 1)."""
    coords = torch.arange(size, dtype=torch.float32)
    return coords.view(1, -1, 1), coords.view(1, 1, -1)


def shapes_cnn(seed: int) -> Problem:
    """16x16 images of a filled square, a disc, a ring or a cross (the class) of random place, size and brightness
    under pixel noise, 5 % of labels redrawn (2,048 images, 1,536 to train); a CNN of two 3x3 convolutions with
    BatchNorm and max pooling, then MLP 512-64-4, SGD with momentum 0.9, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n = 2048
    label = torch.randint(0, 4, (n,), generator=g)
    centre = 4 + 8 * torch.rand(n, 2, 1, 1, generator=g)
    radius = 2.5 + 2.5 * torch.rand(n, 1, 1, generator=g)
    rows, cols = _grid(16)
    dy, dx = (rows - centre[:, 0]).abs(), (cols - centre[:, 1]).abs()
    dist = (dx**2 + dy**2).sqrt()
    masks = torch.stack([dx.maximum(dy) <= radius, dist <= radius, (dist - radius).abs() <= 0.75,
                         ((dx <= 0.75) & (dy <= radius)) | ((dy <= 0.75) & (dx <= radius))], 1).float()
    brightness = 0.5 + torch.rand(n, 1, 1, generator=g)
    image = masks[torch.arange(n), label] * brightness + 0.35 * torch.randn(n, 16, 16, generator=g)
    train, val = _split(image.unsqueeze(1), _flip(label, 4, 0.05, g), 1536)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), _mlp(512, 64, 4))
        return Supervised(net, nn.functional.cross_entropy, "momentum", lr)

    return Problem("synthetic shapes CNN + BatchNorm, momentum", make, train, val)


def gratings_cnn(seed: int) -> Problem:
    """12x12 sinusoidal gratings at one of 4 orientations 45 degrees apart (the class; jittered by 9 degrees), of
    random period and phase, under heavy pixel noise, 5 % of labels redrawn (2,048 images, 1,536 to train); two
    convolutions with GroupNorm, global average pooling and a linear head, Adamax, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 2048
    label = torch.randint(0, 4, (n,), generator=g)
    angle = (label * math.pi / 4 + 0.15 * torch.randn(n, generator=g)).view(n, 1, 1)
    period = (3 + 3 * torch.rand(n, generator=g)).view(n, 1, 1)
    phase = 2 * math.pi * torch.rand(n, 1, 1, generator=g)
    rows, cols = _grid(12)
    wave = torch.sin(2 * math.pi * (cols * angle.cos() + rows * angle.sin()) / period + phase)
    image = wave + 1.75 * torch.randn(n, 12, 12, generator=g)
    train, val = _split(image.unsqueeze(1), _flip(label, 4, 0.05, g), 1536)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Conv2d(1, 16, 5, padding=2), nn.GroupNorm(4, 16), nn.ReLU(),
                            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.GroupNorm(8, 32), nn.ReLU(),
                            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))
        return OptimizerSupervised(net, nn.functional.cross_entropy, torch.optim.Adamax, lr)

    return Problem("texture gratings CNN + GroupNorm, Adamax", make, train, val, batch_size=64)


# ---------------------------------------------------------------------------------------------- tabular and regression
class _EmbeddingTabular(nn.Module):
    """Categorical columns (stored as floats in the first columns of ``x``) through embeddings of their own,
    concatenated with the numeric columns, then an MLP with dropout."""

    def __init__(self, cardinalities: Sequence[int], dims: Sequence[int], numeric: int, dropout: float) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(c, d) for c, d in zip(cardinalities, dims, strict=True))
        self.mlp = _mlp(sum(dims) + numeric, 64, 32, 1, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.tables)
        codes = x[:, :k].long()
        parts = [table(codes[:, i]) for i, table in enumerate(self.tables)] + [x[:, k:]]
        out: torch.Tensor = self.mlp(torch.cat(parts, 1))
        return out


def categorical_tabular(seed: int) -> Problem:
    """Binary labels drawn (Bernoulli) from a logit of 3 categorical columns (12, 30 and 7 levels: two main
    effects and an interaction) and 5 Gaussian numeric ones (3,072 rows, 2,560 to train); embeddings of 4, 8
    and 3 then MLP 20-64-32-1 with dropout 0.2, AdamW, batch 128."""
    g = torch.Generator().manual_seed(seed)
    n, cardinalities = 3072, (12, 30, 7)
    codes = torch.stack([torch.randint(0, c, (n,), generator=g) for c in cardinalities], 1)
    numeric = torch.randn(n, 5, generator=g)
    logit = (torch.randn(12, generator=g)[codes[:, 0]] + torch.randn(30, generator=g)[codes[:, 1]]
             + torch.randn(12, 7, generator=g)[codes[:, 0], codes[:, 2]] + numeric @ torch.randn(5, generator=g) / 2
             + numeric[:, 0] * numeric[:, 1] / 2)
    label = torch.bernoulli(torch.sigmoid(logit), generator=g)
    train, val = _split(torch.cat([codes.float(), numeric], 1), label, 2560)

    def make(lr: float) -> phalanx.Module:
        return Supervised(_EmbeddingTabular(cardinalities, (4, 8, 3), 5, 0.2), _binary_cross_entropy, "adamw", lr)

    return Problem("categorical-embedding tabular MLP + dropout, AdamW", make, train, val, batch_size=128)


def _pinball(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The pinball (quantile) loss of the columns of ``pred`` as the 10th, 50th and 90th percentiles of ``y``."""
    q = torch.tensor([0.1, 0.5, 0.9])
    err = y - pred
    return torch.maximum(q * err, (q - 1) * err).mean()


def quantile_regression(seed: int) -> Problem:
    """y = x.a + sin(2 x.b)/2 + skewed (exponential) noise whose spread depends on x.c, from 5 Gaussian features
    (1,280 samples, 768 to train); MLP 5-128-128-3 giving three quantiles, pinball loss, SGD with momentum 0.9,
    batch 8."""
    g = torch.Generator().manual_seed(seed)
    n = 1280
    x = torch.randn(n, 5, generator=g)
    a, b, c = (torch.randn(5, 1, generator=g) / 2 for _ in range(3))
    noise = -torch.rand(n, 1, generator=g).log() - 1
    train, val = _split(x, x @ a + torch.sin(2 * x @ b) / 2 + (0.5 + torch.sigmoid(2 * x @ c)) * noise, 768)

    def make(lr: float) -> phalanx.Module:
        return Supervised(_mlp(5, 128, 128, 3), _pinball, "momentum", lr)

    return Problem("quantile-regression MLP (pinball loss), momentum", make, train, val, batch_size=8)


class _ResidualBNMLP(nn.Module):
    """A ResNet-style MLP: a stem, ``blocks`` post-activation residual blocks of two BatchNorm linear layers, a
    linear head (2 + 2 x ``blocks`` layers)."""

    def __init__(self, features: int, width: int, blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(features, width), nn.BatchNorm1d(width), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(),
                                                  nn.Linear(width, width), nn.BatchNorm1d(width))
                                    for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = nn.functional.relu(h + block(h))
        out: torch.Tensor = self.head(h)
        return out


def friedman3_resnet(seed: int) -> Problem:
    """sklearn's third Friedman problem (4 features and the target standardised, plus noise of 0.3 of its
    spread; 3,072 samples, 2,560 to train); a 6-layer ResNet-style MLP of width 64 with BatchNorm, plain SGD,
    batch 256."""
    from sklearn.datasets import make_friedman3

    x, y = make_friedman3(3072, random_state=seed)
    target = _standardised(_tensor(y).unsqueeze(1))
    target = target + 0.3 * torch.randn(target.shape, generator=torch.Generator().manual_seed(seed))
    train, val = _split(_standardised(_tensor(x)), target, 2560)
    return Problem("Friedman 3 ResNet-style MLP + BatchNorm, SGD",
                   lambda lr: Supervised(_ResidualBNMLP(4, 64), nn.functional.mse_loss, "sgd", lr), train, val,
                   batch_size=256)


def _class_and_value(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the first 3 outputs against the class in ``y[:, 0]`` plus the squared error of the last
    against the value in ``y[:, 1]``."""
    return (nn.functional.cross_entropy(out[:, :3], y[:, 0].long())
            + nn.functional.mse_loss(out[:, 3], y[:, 1]))


def multitask(seed: int) -> Problem:
    """A class (of 3, drawn from the softmax of a random tanh teacher) and a value (the teacher's linear readout
    plus noise of spread 0.5) from 12 Gaussian features (2,048 samples, 1,536 to train); MLP 12-64-64-4 with
    both heads on one trunk, their losses summed, plain SGD, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n = 2048
    x = torch.randn(n, 12, generator=g)
    hidden = torch.tanh(x @ torch.randn(12, 16, generator=g) / 2)
    gumbel = -(-torch.rand(n, 3, generator=g).log()).log()  # argmax(logits + Gumbel noise) samples the softmax
    label = (hidden @ torch.randn(16, 3, generator=g) + gumbel).argmax(1)
    value = hidden @ torch.randn(16, generator=g) / 2 + 0.5 * torch.randn(n, generator=g)
    train, val = _split(x, torch.stack([label.float(), value], 1), 1536)
    return Problem("multi-task MLP (class + value), SGD",
                   lambda lr: Supervised(_mlp(12, 64, 64, 4), _class_and_value, "sgd", lr), train, val)


def wide_classification(seed: int) -> Problem:
    """sklearn's make_classification with 100 features (10 informative, 20 redundant, class separation 0.8, 10 %
    of labels flipped; standardised), 3,072 samples, 2,560 to train; MLP 100-32-1, AdamW, batch 512."""
    from sklearn.datasets import make_classification

    x, y = make_classification(3072, n_features=100, n_informative=10, n_redundant=20, class_sep=0.8, flip_y=0.1,
                               random_state=seed)
    train, val = _split(_standardised(_tensor(x)), _tensor(y), 2560)
    return Problem("100-feature make_classification MLP, AdamW",
                   lambda lr: Supervised(_mlp(100, 32, 1), _binary_cross_entropy, "adamw", lr),
                   train, val, batch_size=512)


def signal_denoiser(seed: int) -> Problem:
    """Piecewise-constant signals of 64 steps (a jump with probability 0.06 per step to a Gaussian level) under
    Gaussian noise of spread 0.7, the clean signal the target (2,048 signals, 1,536 to train); a bottleneck MLP
    64-128-32-128-64 with LayerNorm, mean squared error, Adam, batch 16."""
    g = torch.Generator().manual_seed(seed)
    n, length = 2048, 64
    segment = (torch.rand(n, length, generator=g) < 0.06).long().cumsum(1)
    clean = torch.randn(n, length + 1, generator=g).gather(1, segment)
    train, val = _split(clean + 0.7 * torch.randn(n, length, generator=g), clean, 1536)

    def make(lr: float) -> phalanx.Module:
        return Supervised(_mlp(64, 128, 32, 128, 64, norm=nn.LayerNorm), nn.functional.mse_loss, "adam", lr)

    return Problem("piecewise-constant signal denoiser MLP + LayerNorm, Adam", make, train, val, batch_size=16)


# ---------------------------------------------------------------------------------------------- pairs and sets
class _Siamese(nn.Module):
    """One encoder MLP applied to both members of a pair; a head on |e1 - e2| and e1 * e2 scores "same"."""

    def __init__(self, features: int, width: int = 64, embedding: int = 32) -> None:
        super().__init__()
        self.encoder = _mlp(features, width, embedding)
        self.head = _mlp(2 * embedding, 32, 1)

    def forward(self, pair: torch.Tensor) -> torch.Tensor:
        a, b = self.encoder(pair[:, 0]), self.encoder(pair[:, 1])
        out: torch.Tensor = self.head(torch.cat([(a - b).abs(), a * b], 1))
        return out


def siamese_pairs(seed: int) -> Problem:
    """Pairs of noisy 16-D samples of 12 identities (Gaussian clusters that overlap), labelled same or different
    identity half the time each (2,560 pairs, 2,048 to train); a siamese MLP, binary cross-entropy, NAdam, batch
    64."""
    g = torch.Generator().manual_seed(seed)
    n, identities = 2560, 12
    centres = torch.randn(identities, 16, generator=g)
    first = torch.randint(0, identities, (n,), generator=g)
    same = torch.rand(n, generator=g) < 0.5
    second = torch.where(same, first, (first + torch.randint(1, identities, (n,), generator=g)) % identities)
    x = centres[torch.stack([first, second], 1)] + 1.2 * torch.randn(n, 2, 16, generator=g)
    train, val = _split(x, same.float(), 2048)
    return Problem("siamese pair-matching MLP, NAdam",
                   lambda lr: OptimizerSupervised(_Siamese(16), _binary_cross_entropy, torch.optim.NAdam, lr),
                   train, val, batch_size=64)


class _DeepSets(nn.Module):
    """A per-point MLP with LayerNorm, mean-pooled over the set, then an MLP on the pooled vector."""

    def __init__(self, features: int, width: int, classes: int) -> None:
        super().__init__()
        self.point = _mlp(features, width, width, norm=nn.LayerNorm)
        self.pooled = nn.Sequential(nn.ReLU(), _mlp(width, width, classes))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.pooled(self.point(points).mean(1))
        return out


def point_sets(seed: int) -> Problem:
    """Sets of 24 points in 2-D drawn from a ring, a segment, a blob or two blobs (the class), centred, randomly
    rotated and scaled (0.75 to 1.25), under noise, 5 % of labels redrawn (2,048 sets, 1,536 to train); a
    DeepSets model of width 64 with LayerNorm, AdamW, batch 128."""
    g = torch.Generator().manual_seed(seed)
    n, size = 2048, 24
    label = torch.randint(0, 4, (n,), generator=g)
    t = torch.rand(n, size, generator=g)
    zero = torch.zeros(n, size)
    shapes = torch.stack([
        torch.stack([torch.cos(2 * math.pi * t), torch.sin(2 * math.pi * t)], -1),
        torch.stack([2 * t - 1, zero], -1),
        0.4 * torch.randn(n, size, 2, generator=g),
        torch.stack([torch.sign(t - 0.5) * 0.8, zero], -1) + 0.25 * torch.randn(n, size, 2, generator=g),
    ], 1)[torch.arange(n), label]
    angle = 2 * math.pi * torch.rand(n, generator=g)
    rotation = torch.stack([torch.stack([angle.cos(), -angle.sin()], -1),
                            torch.stack([angle.sin(), angle.cos()], -1)], -2)
    scale = 0.75 + 0.5 * torch.rand(n, 1, 1, generator=g)
    points = scale * shapes @ rotation + 0.1 * torch.randn(n, size, 2, generator=g)
    train, val = _split(points, _flip(label, 4, 0.05, g), 1536)
    return Problem("point-set DeepSets + LayerNorm, AdamW",
                   lambda lr: Supervised(_DeepSets(2, 64, 4), nn.functional.cross_entropy, "adamw", lr), train, val,
                   batch_size=128)


# ---------------------------------------------------------------------------------------------- sequences
class _Tagger(nn.Module):
    """Embedding 16, a bidirectional GRU of ``hidden`` units each way, a tag per position."""

    def __init__(self, vocab: int, tags: int, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.rnn = nn.GRU(16, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, tags)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(x))
        out: torch.Tensor = self.head(hidden)
        return out


def hmm_tagger(seed: int) -> Problem:
    """Sequences of 20 tokens (vocabulary 24) emitted by a random hidden Markov model of 5 sticky states with
    overlapping emissions, each token tagged with its hidden state (1,280 sequences, 1,024 to train); a
    bidirectional GRU tagger, RAdam, batch 32."""
    g = torch.Generator().manual_seed(seed)
    states, vocab, length, n = 5, 24, 20, 1280
    transition = 0.7 * torch.eye(states) + 0.3 * torch.rand(states, states, generator=g).softmax(-1)
    emission = (1.5 * torch.randn(states, vocab, generator=g)).softmax(-1)
    state = torch.randint(0, states, (n,), generator=g)
    tokens, tags = torch.empty(n, length, dtype=torch.long), torch.empty(n, length, dtype=torch.long)
    for t in range(length):
        tags[:, t] = state
        tokens[:, t] = torch.multinomial(emission[state], 1, generator=g).squeeze(1)
        state = torch.multinomial(transition[state], 1, generator=g).squeeze(1)
    train, val = _split(tokens, tags, 1024)
    return Problem("HMM state-tagging bidirectional GRU, RAdam",
                   lambda lr: OptimizerSupervised(_Tagger(vocab, states), token_cross_entropy, torch.optim.RAdam, lr),
                   train, val)


class _SentimentLSTM(nn.Module):
    """Embedding 16 with dropout, an LSTM of 32 units, a logit from its last hidden state."""

    def __init__(self, vocab: int, dropout: float = 0.2) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Embedding(vocab, 16), nn.Dropout(dropout))
        self.rnn = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (last, _) = self.rnn(self.embed(x))
        out: torch.Tensor = self.head(last[-1])
        return out


def negation_lstm(seed: int) -> Problem:
    """Sequences of 20 tokens from 32: 10 positive and 10 negative words of random strength, 11 neutral ones and
    "not", which flips the next word; labelled by the sign of the summed sentiment plus noise (2,048 sequences,
    1,536 to train); an LSTM with embedding dropout 0.2, binary cross-entropy, Adam, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab = 2048, 20, 32
    strength = torch.cat([0.5 + torch.rand(10, generator=g), -0.5 - torch.rand(10, generator=g), torch.zeros(12)])
    tokens = torch.randint(0, vocab - 1, (n, length), generator=g)
    tokens = torch.where(torch.rand(n, length, generator=g) < 0.12, vocab - 1, tokens)
    negated = torch.cat([torch.zeros(n, 1, dtype=torch.bool), tokens[:, :-1] == vocab - 1], 1)
    score = (strength[tokens] * torch.where(negated, -1.0, 1.0)).sum(1) + 1.5 * torch.randn(n, generator=g)
    train, val = _split(tokens, (score > 0).float(), 1536)
    return Problem("negation-sentiment LSTM + dropout, Adam",
                   lambda lr: Supervised(_SentimentLSTM(vocab), _binary_cross_entropy, "adam", lr), train, val,
                   batch_size=64)


HELD_OUT: list[Family] = [shapes_cnn, gratings_cnn, categorical_tabular, quantile_regression, friedman3_resnet,
                          multitask, wide_classification, signal_denoiser, siamese_pairs, point_sets, hmm_tagger,
                          negation_lstm]
