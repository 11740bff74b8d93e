"""The eighth set of LR-finder problem families, ``EIGHTH_SET`` (12): written on 2026-11-29, after the seventh set,
by someone who never ran the LR finder on them nor saw any of its results or logs. Only plain fits on the
learning-rate grid (and the initial loss) were run on them while they were written, to check that each trains,
that its best loss stays well above 0, that its best learning rate lies inside the grid and that a fit is cheap;
never the LR finder.

None repeats an earlier family's kind of data, model or loss. Between them: Adam (1), AdamW (1), plain SGD (2),
SGD with momentum 0.9 (2), SGD with Nesterov momentum 0.9 (1), RMSprop (1), Adagrad (1), NAdam (1), RAdam (1) and
Adamax (1); a graph convolutional network on random graphs, a gated dilated causal CNN (WaveNet-like) forecaster,
a small vision transformer on image patches, a mixture of experts under a focal loss, a variational autoencoder
(the negative ELBO), knowledge distillation from a fixed teacher (cross-entropy to its soft targets), a two-tower
contrastive model (symmetric InfoNCE with in-batch negatives), a GRU encoder-decoder reversing sequences, a deep
narrow SiLU MLP without normalisation, a depthwise-separable CNN under a multi-class hinge loss, a pairwise
ranking model and a masked-token transformer encoder; three sequence models (the forecaster, the
encoder-decoder and the masked-token encoder); with and without BatchNorm, LayerNorm or dropout; batches of 8 to
256. Data are drawn by a ``torch.Generator`` from the seed; every one has label or target noise (or real
ambiguity), so the best validation loss stays well above 0. Validation sets hold at least 256 samples.
"""

from __future__ import annotations

import math

import torch
from _lr_families import Family, _mlp, _split, _standardised, token_cross_entropy
from _lr_fourth_set import AdagradSupervised, NesterovSupervised, _flip
from _lr_held_out import OptimizerSupervised, _grid
from _lr_problems import Problem, Supervised
from _lr_second_set import RMSpropSupervised, _binary_cross_entropy
from torch import nn

import phalanx


# ---------------------------------------------------------------------------------------------- structured inputs
class _GraphConvNet(nn.Module):
    """Two graph convolutions (normalised adjacency times a linear map, ReLU) of ``width`` units, mean- and
    max-pooled over the nodes, then a linear head. Its input packs, per node, the row of the normalised adjacency
    (self-loops included) and the node's features, so that a batch of graphs is one tensor."""

    def __init__(self, nodes: int, features: int, width: int, classes: int) -> None:
        super().__init__()
        self.nodes = nodes
        self.layers = nn.ModuleList([nn.Linear(features, width), nn.Linear(width, width)])
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adjacency, h = x[..., :self.nodes], x[..., self.nodes:]
        for layer in self.layers:
            h = torch.relu(adjacency @ layer(h))
        out: torch.Tensor = self.head(torch.cat([h.mean(1), h.amax(1)], 1))
        return out


def homophily_gcn(seed: int) -> Problem:
    """Random graphs of 12 nodes, each node of colour +-1 (seen under noise of spread 0.5, with 3 more noise
    features); an edge joins two nodes of the same colour with probability 0.5, 0.3 or 0.1 and of different
    colours with 0.6 minus that, so that the class (homophilous, neutral, heterophilous) leaves the expected degree
    alone and only shows in who links to whom; 5 % of labels redrawn (1,536 graphs, 1,024 to train); a two-layer
    graph convolutional network, cross-entropy, SGD with momentum 0.9, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, nodes = 1536, 12
    label = torch.randint(0, 3, (n,), generator=g)
    colour = 2 * torch.randint(0, 2, (n, nodes), generator=g).float() - 1
    p_same = torch.tensor([0.5, 0.3, 0.1])[label].view(n, 1, 1)
    p = torch.where(colour.unsqueeze(1) == colour.unsqueeze(2), p_same, 0.6 - p_same)
    upper = (torch.rand(n, nodes, nodes, generator=g) < p).float().triu(1)
    loops = upper + upper.transpose(1, 2) + torch.eye(nodes)
    degree = loops.sum(2)
    adjacency = loops / (degree.unsqueeze(1) * degree.unsqueeze(2)).sqrt()
    features = torch.cat([colour.unsqueeze(2) + 0.5 * torch.randn(n, nodes, 1, generator=g),
                          torch.randn(n, nodes, 3, generator=g)], 2)
    train, val = _split(torch.cat([adjacency, features], 2), _flip(label, 3, 0.05, g), 1024)
    return Problem("graph-homophily GCN, momentum",
                   lambda lr: Supervised(_GraphConvNet(nodes, 4, 32, 3), nn.functional.cross_entropy, "momentum", lr),
                   train, val)


class _MixtureOfExperts(nn.Module):
    """A softmax gate over ``experts`` MLPs (features-``hidden``-out), their outputs averaged by its weights."""

    def __init__(self, features: int, experts: int, hidden: int, out: int) -> None:
        super().__init__()
        self.gate = nn.Linear(features, experts)
        self.experts = nn.ModuleList(_mlp(features, hidden, out) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.gate(x).softmax(1).unsqueeze(2)
        out: torch.Tensor = (weights * torch.stack([expert(x) for expert in self.experts], 1)).sum(1)
        return out


def _focal_loss(logits: torch.Tensor, y: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    log_p = logits.log_softmax(1).gather(1, y.unsqueeze(1)).squeeze(1)
    return (-((1 - log_p.exp()) ** gamma) * log_p).mean()


def regime_experts_focal(seed: int) -> Problem:
    """8 Gaussian features; the signs of the first two pick one of 4 regimes, and in each a linear teacher of its
    own on the other six gives the logits of 3 classes, the label drawn from their softmax (2,048 samples, 1,536 to
    train); a mixture of 4 MLP experts (8-32-3) under a softmax gate, focal loss (gamma 2), Adagrad, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n = 2048
    x = torch.randn(n, 8, generator=g)
    regime = 2 * (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    teachers = torch.randn(4, 6, 3, generator=g)
    logits = torch.einsum("nf,nfc->nc", x[:, 2:], teachers[regime])
    train, val = _split(x, torch.multinomial(logits.softmax(1), 1, generator=g).squeeze(1), 1536)
    return Problem("regime mixture of experts (focal loss), Adagrad",
                   lambda lr: AdagradSupervised(_MixtureOfExperts(8, 4, 32, 3), _focal_loss, lr), train, val)


class _VAE(nn.Module):
    """A variational autoencoder with a Gaussian posterior: encoder features-64-(2 x latent), decoder
    latent-64-features; it returns the reconstruction of one sample of the posterior and the KL term per row."""

    def __init__(self, features: int, latent: int) -> None:
        super().__init__()
        self.encoder, self.decoder = _mlp(features, 64, 2 * latent), _mlp(latent, 64, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, log_var = self.encoder(x).chunk(2, 1)
        z = mean + (0.5 * log_var).exp() * torch.randn_like(mean)  # the reparameterisation; seeded by the fit
        kl = 0.5 * (mean**2 + log_var.exp() - 1 - log_var).sum(1, keepdim=True)
        return torch.cat([self.decoder(z), kl], 1)


def _negative_elbo(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # A unit-variance Gaussian decoder (its constant left out): half the squared error plus the KL term, per row.
    return (0.5 * ((out[:, :-1] - x) ** 2).sum(1) + out[:, -1]).mean()


def manifold_vae(seed: int) -> Problem:
    """20 features (standardised) from a 2-D Gaussian latent through a fixed random tanh layer of 16 units and a
    linear map, plus noise of spread 0.3 (4,096 samples, 3,072 to train); a VAE with 4 latent units, the negative
    ELBO, Adamax, batch 128."""
    g = torch.Generator().manual_seed(seed)
    n = 4096
    hidden = torch.tanh(torch.randn(n, 2, generator=g) @ torch.randn(2, 16, generator=g)
                        + torch.randn(16, generator=g) / 2)
    x = _standardised(hidden @ torch.randn(16, 20, generator=g) / 4 + 0.3 * torch.randn(n, 20, generator=g))
    train, val = _split(x, x, 3072)
    return Problem("latent-manifold VAE (negative ELBO), Adamax",
                   lambda lr: OptimizerSupervised(_VAE(20, 4), _negative_elbo, torch.optim.Adamax, lr), train, val,
                   batch_size=128)


def soft_target_distillation(seed: int) -> Problem:
    """A fixed random teacher (a tanh MLP 16-64-64-10 drawn from the seed, its logits of spread about 5) gives soft
    targets (its softmax at temperature 2) on 16 Gaussian features (8,192 samples, 7,680 to train); a smaller
    student MLP 16-48-10 learns them by cross-entropy to the soft targets (their KL divergence plus the teacher's
    entropy, a floor well above 0), SGD with Nesterov momentum 0.9, batch 256."""
    g = torch.Generator().manual_seed(seed)
    n = 8192
    x = torch.randn(n, 16, generator=g)
    weights = [torch.randn(a, b, generator=g) / math.sqrt(a) for a, b in ((16, 64), (64, 64), (64, 10))]
    teacher = torch.tanh(torch.tanh(x @ weights[0]) @ weights[1]) @ weights[2] * 12
    train, val = _split(x, (teacher / 2).softmax(1), 7680)
    return Problem("soft-target distillation MLP, Nesterov",
                   lambda lr: NesterovSupervised(_mlp(16, 48, 10), nn.functional.cross_entropy, lr), train, val,
                   batch_size=256)


class _TwoTowers(nn.Module):
    """Two MLP towers with LayerNorm (one per view, 16-64-32 and 12-64-32), each output scaled to unit length."""

    def __init__(self, a_features: int, b_features: int) -> None:
        super().__init__()
        self.split = a_features
        self.a = _mlp(a_features, 64, 32, norm=nn.LayerNorm)
        self.b = _mlp(b_features, 64, 32, norm=nn.LayerNorm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x[:, :self.split]), self.b(x[:, self.split:])
        return torch.stack([nn.functional.normalize(a, dim=1), nn.functional.normalize(b, dim=1)], 1)


def _info_nce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Each row's other view is its positive, the batch's other rows its negatives; both directions, temperature 0.2.
    logits = out[:, 0] @ out[:, 1].T / 0.2
    targets = torch.arange(len(out))
    return (nn.functional.cross_entropy(logits, targets) + nn.functional.cross_entropy(logits.T, targets)) / 2


def two_view_infonce(seed: int) -> Problem:
    """Pairs of views of one 6-D Gaussian latent, each view from its own noisy copy of it (noise of spread 0.6):
    a tanh of a random map to 16 features and a random linear map to 12 (2,560 pairs, 2,048 to train, validated in
    batches of 256); a two-tower model with LayerNorm, symmetric InfoNCE with in-batch negatives, RAdam, batch
    64."""
    g = torch.Generator().manual_seed(seed)
    n = 2560
    z = torch.randn(n, 6, generator=g)
    a = torch.tanh((z + 0.6 * torch.randn(n, 6, generator=g)) @ torch.randn(6, 16, generator=g) / 2)
    b = (z + 0.6 * torch.randn(n, 6, generator=g)) @ torch.randn(6, 12, generator=g) / math.sqrt(6)
    train, val = _split(torch.cat([a, b], 1), torch.zeros(n), 2048)
    return Problem("two-view contrastive towers + LayerNorm (InfoNCE), RAdam",
                   lambda lr: OptimizerSupervised(_TwoTowers(16, 12), _info_nce, torch.optim.RAdam, lr), train, val,
                   batch_size=64)


def _deep_narrow() -> nn.Sequential:
    """MLP 8-32-...-32-1, 10 linear layers, SiLU, He-initialised with zero biases: PyTorch's default initialisation
    shrinks the signal by about a third per layer, and at this depth nothing but the mean reached the output."""
    net = _mlp(8, *[32] * 9, 1, act=nn.SiLU)
    for layer in net:
        if isinstance(layer, nn.Linear):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
    return net


def deep_narrow_silu(seed: int) -> Problem:
    """y = sin(x.a) cos(x.b) + x.c/2 from 8 Gaussian features, standardised, plus noise of spread 0.3 (1,280
    samples, 1,024 to train); a deep narrow MLP (10 linear layers of width 32, SiLU, no normalisation), mean squared
    error, plain SGD, batch 16."""
    g = torch.Generator().manual_seed(seed)
    n = 1280
    x = torch.randn(n, 8, generator=g)
    a, b, c = (torch.randn(8, 1, generator=g) / 2 for _ in range(3))
    y = _standardised(torch.sin(x @ a) * torch.cos(x @ b) + x @ c / 2) + 0.3 * torch.randn(n, 1, generator=g)
    train, val = _split(x, y, 1024)
    return Problem("deep narrow SiLU MLP regression, SGD",
                   lambda lr: Supervised(_deep_narrow(), nn.functional.mse_loss, "sgd", lr),
                   train, val, batch_size=16)


class _PairScorer(nn.Module):
    """One scoring MLP (10-64-64-1, dropout 0.1) applied to both items of a pair; the difference of their scores."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.score = _mlp(features, 64, 64, 1, dropout=0.1)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.score(pairs[:, 0]) - self.score(pairs[:, 1])
        return out


def pairwise_ranking(seed: int) -> Problem:
    """Pairs of items of 10 Gaussian features whose utility is a random tanh teacher's (standardised); the first is
    preferred with probability sigmoid(2 (u1 - u2)) (Bradley-Terry; 1,024 pairs, 768 to train); a pairwise
    (RankNet) scorer with dropout, binary cross-entropy on the score difference, plain SGD, batch 8."""
    g = torch.Generator().manual_seed(seed)
    n = 1024
    items = torch.randn(n, 2, 10, generator=g)
    utility = _standardised((torch.tanh(items @ torch.randn(10, 16, generator=g) / 2)
                             @ torch.randn(16, 1, generator=g)).view(-1, 1)).view(n, 2)
    preferred = torch.rand(n, generator=g) < torch.sigmoid(2 * (utility[:, 0] - utility[:, 1]))
    train, val = _split(items, preferred.float(), 768)
    return Problem("pairwise-preference ranking MLP + dropout, SGD",
                   lambda lr: Supervised(_PairScorer(10), _binary_cross_entropy, "sgd", lr), train, val,
                   batch_size=8)


# ---------------------------------------------------------------------------------------------- images
class _PatchTransformer(nn.Module):
    """A tiny vision transformer: 4x4 patches of a 16x16 image embedded to 32 with learned positions, one
    pre-LayerNorm transformer block (4 heads, feed-forward 64, dropout 0.1), mean-pooled, LayerNorm and a head."""

    def __init__(self, classes: int, size: int = 16, patch: int = 4, d: int = 32) -> None:
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(patch * patch, d)
        self.position = nn.Parameter(0.02 * torch.randn(1, (size // patch) ** 2, d))
        self.block = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch
        patches = x.unfold(2, p, p).unfold(3, p, p).reshape(len(x), -1, p * p)
        out: torch.Tensor = self.head(self.block(self.embed(patches) + self.position).mean(1))
        return out


def blob_relation_vit(seed: int) -> Problem:
    """16x16 images of a bright and a dark Gaussian blob (spread 1.5 pixels), the dark one 3 to 6 pixels left of,
    right of, above or below the bright one (the class), jittered across by up to 1.5 pixels and kept inside the
    image, under pixel noise of spread 0.3, 5 % of labels redrawn (2,816 images, 2,560 to train); a tiny vision
    transformer on 4x4 patches, cross-entropy, AdamW, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 2816
    label = torch.randint(0, 4, (n,), generator=g)
    direction = torch.tensor([[0.0, -1.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 0.0]])[label]
    bright = 2 + 12 * torch.rand(n, 2, generator=g)
    across = direction.flip(1) * (3 * torch.rand(n, 1, generator=g) - 1.5)
    dark = (bright + direction * (3 + 3 * torch.rand(n, 1, generator=g)) + across).clamp(1, 14)
    rows, cols = _grid(16)

    def blob(place: torch.Tensor) -> torch.Tensor:
        dist2 = (rows - place[:, 0].view(n, 1, 1)) ** 2 + (cols - place[:, 1].view(n, 1, 1)) ** 2
        return (-dist2 / (2 * 1.5**2)).exp()

    image = blob(bright) - blob(dark) + 0.3 * torch.randn(n, 16, 16, generator=g)
    train, val = _split(image.unsqueeze(1), _flip(label, 4, 0.05, g), 2560)
    return Problem("blob-relation vision transformer + LayerNorm + dropout, AdamW",
                   lambda lr: Supervised(_PatchTransformer(4), nn.functional.cross_entropy, "adamw", lr), train, val,
                   batch_size=64)


def _separable(cin: int, cout: int) -> list[nn.Module]:
    """A depthwise 3x3 convolution, a pointwise 1x1 one, BatchNorm and ReLU."""
    return [nn.Conv2d(cin, cin, 3, padding=1, groups=cin), nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout), nn.ReLU()]


def stroke_orientation_hinge(seed: int) -> Problem:
    """12x12 images of 12 short strokes (3 pixels) at random places, each horizontal, vertical or along either
    diagonal: the class's orientation with probability 0.5, each other one with 1/6, so that the drawn strokes can
    outvote the class; under pixel noise of spread 0.4 (2,048 images, 1,536 to train); a depthwise-separable CNN
    with BatchNorm, multi-class hinge loss, SGD with momentum 0.9, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n, strokes = 2048, 12
    label = torch.randint(0, 4, (n,), generator=g)
    other = (label.unsqueeze(1) + torch.randint(1, 4, (n, strokes), generator=g)) % 4
    orientation = torch.where(torch.rand(n, strokes, generator=g) < 0.5, label.unsqueeze(1), other)
    step = torch.tensor([[0, 1], [1, 0], [1, 1], [1, -1]])[orientation]
    centre = torch.randint(1, 11, (n, strokes, 2), generator=g)
    pixels = torch.cat([centre - step, centre, centre + step], 1)
    image = torch.zeros(n, 144).scatter_add_(1, pixels[..., 0] * 12 + pixels[..., 1], torch.ones(n, 3 * strokes))
    image = image.view(n, 1, 12, 12) + 0.4 * torch.randn(n, 1, 12, 12, generator=g)
    train, val = _split(image, label, 1536)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), *_separable(16, 32),
                            nn.MaxPool2d(2), *_separable(32, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                            nn.Linear(32, 4))
        return Supervised(net, nn.functional.multi_margin_loss, "momentum", lr)

    return Problem("stroke-orientation depthwise-separable CNN + BatchNorm (hinge loss), momentum", make, train, val,
                   batch_size=64)


# ---------------------------------------------------------------------------------------------- sequences
class _GatedDilatedConv(nn.Module):
    """A WaveNet-like causal forecaster: a 1x1 stem to 16 channels, four residual gated (tanh x sigmoid) causal
    convolutions of kernel 2 and dilations 1, 2, 4, 8, then ReLU and a 1x1 head: the next value at every step."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.dilations = (1, 2, 4, 8)
        self.stem = nn.Conv1d(1, channels, 1)
        self.filters = nn.ModuleList(nn.Conv1d(channels, 2 * channels, 2, dilation=d) for d in self.dilations)
        self.mixes = nn.ModuleList(nn.Conv1d(channels, channels, 1) for _ in self.dilations)
        self.head = nn.Sequential(nn.ReLU(), nn.Conv1d(channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for dilation, conv, mix in zip(self.dilations, self.filters, self.mixes, strict=True):
            # Left padding only, so that step t sees nothing after t.
            a, b = conv(nn.functional.pad(h, (dilation, 0))).chunk(2, 1)
            h = h + mix(torch.tanh(a) * torch.sigmoid(b))
        out: torch.Tensor = self.head(h)
        return out


def seasonal_wavenet(seed: int) -> Problem:
    """Series of 64 steps: two sinusoids of the series' own periods (4 to 24 steps), amplitudes and phases plus
    AR(1) noise (coefficient 0.7, innovations of spread 0.4), standardised, each next value the target (2,048
    series, 1,536 to train); a gated dilated causal CNN, mean squared error over the steps, RMSprop, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n, length = 2048, 65
    t = torch.arange(length, dtype=torch.float32)
    period = 4 + 20 * torch.rand(n, 2, 1, generator=g)
    phase = 2 * math.pi * torch.rand(n, 2, 1, generator=g)
    amplitude = 0.5 + torch.rand(n, 2, 1, generator=g)
    series = (amplitude * torch.sin(2 * math.pi * t / period + phase)).sum(1)
    noise = torch.zeros(n)
    for step in range(length):
        noise = 0.7 * noise + 0.4 * torch.randn(n, generator=g)
        series[:, step] += noise
    series = (series / series.std()).unsqueeze(1)
    train, val = _split(series[..., :-1], series[..., 1:], 1536)
    return Problem("seasonal gated dilated causal CNN forecaster, RMSprop",
                   lambda lr: RMSpropSupervised(_GatedDilatedConv(), nn.functional.mse_loss, lr), train, val,
                   batch_size=64)


class _ReverseSeq2Seq(nn.Module):
    """A GRU encoder-decoder (embedding 24, 48 units each) without attention: the encoder's last state starts the
    decoder, which reads the target shifted right (teacher forcing). Its input packs the source, then the decoder's
    input, along the sequence."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab + 1, 24)  # the last token starts the decoder
        self.encoder = nn.GRU(24, 48, batch_first=True)
        self.decoder = nn.GRU(24, 48, batch_first=True)
        self.head = nn.Linear(48, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source, shifted = x.chunk(2, 1)
        _, state = self.encoder(self.embed(source))
        hidden, _ = self.decoder(self.embed(shifted), state)
        out: torch.Tensor = self.head(hidden)
        return out


def reverse_seq2seq_gru(seed: int) -> Problem:
    """Sequences of 8 tokens from 10 to be written out reversed, 10 % of the target tokens replaced by uniformly
    drawn ones (1,280 sequences, 1,024 to train); a GRU encoder-decoder with teacher forcing, cross-entropy per
    target token, Adam, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab = 1280, 8, 10
    source = torch.randint(0, vocab, (n, length), generator=g)
    target = torch.where(torch.rand(n, length, generator=g) < 0.1, torch.randint(0, vocab, (n, length), generator=g),
                         source.flip(1))
    shifted = torch.cat([torch.full((n, 1), vocab), target[:, :-1]], 1)
    train, val = _split(torch.cat([source, shifted], 1), target, 1024)
    return Problem("sequence-reversal GRU encoder-decoder, Adam",
                   lambda lr: Supervised(_ReverseSeq2Seq(vocab), token_cross_entropy, "adam", lr), train, val)


class _MaskedEncoder(nn.Module):
    """Token (the vocabulary and a mask token) and learned position embeddings of 32, one post-LayerNorm
    transformer block (4 heads, feed-forward 64, no dropout), a head over the vocabulary at every position."""

    def __init__(self, vocab: int, length: int, d: int = 32) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab + 1, d), nn.Embedding(length, d)
        self.block = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(self.embed(x) + self.position.weight))
        return out


def masked_token_transformer(seed: int) -> Problem:
    """Sequences of 16 tokens from a random first-order Markov chain over 16 symbols (each with 3 likely
    successors); 20 % of positions replaced by a mask token, their original tokens the targets (the others ignored;
    2,304 sequences, 2,048 to train); a one-block transformer encoder, cross-entropy on the masked positions, NAdam,
    batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab = 2304, 16, 16
    logits = torch.full((vocab, vocab), -4.0)
    logits.scatter_(1, torch.rand(vocab, vocab, generator=g).argsort(1)[:, :3], 2 * torch.rand(vocab, 3, generator=g))
    probs = logits.softmax(1)
    tokens = torch.empty(n, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, length):
        tokens[:, t] = torch.multinomial(probs[tokens[:, t - 1]], 1, generator=g).squeeze(1)
    masked = torch.rand(n, length, generator=g) < 0.2
    train, val = _split(torch.where(masked, vocab, tokens), torch.where(masked, tokens, -100), 2048)
    return Problem("masked-token transformer encoder + LayerNorm, NAdam",
                   lambda lr: OptimizerSupervised(_MaskedEncoder(vocab, length), token_cross_entropy,
                                                  torch.optim.NAdam, lr), train, val)


EIGHTH_SET: list[Family] = [homophily_gcn, regime_experts_focal, manifold_vae, soft_target_distillation,
                            two_view_infonce, deep_narrow_silu, pairwise_ranking, blob_relation_vit,
                            stroke_orientation_hinge, seasonal_wavenet, reverse_seq2seq_gru, masked_token_transformer]
