"""The eleventh set of LR-finder problem families, ``ELEVENTH_SET`` (12): written after the tenth set, blind, by
someone who never ran the LR finder on them nor saw any of its results or logs. Only plain fits on the
learning-rate grid (and the initial loss) were run on them while they were written, to check that each trains,
that its best loss stays well above 0, that its best learning rate lies inside the grid and that a fit is cheap;
never the LR finder.

None repeats an earlier family's kind of data, model or loss. Between them: Adam (1), Adam with AMSGrad (1), AdamW
(1), plain SGD (1), SGD with momentum 0.9 (1), SGD with Nesterov momentum 0.9 (1), RMSprop (1), Adagrad (1),
Adadelta (1), NAdam (1), RAdam (1) and Adamax (1); a tiny Hugging Face Mistral (sliding-window attention) as a
causal LM, a tiny Hugging Face ViT classifying images from its config, a graph attention network over batches of
small graphs, a radial-basis-function network with learned centres and widths, a factorisation machine on
categorical click data, an energy model fitted by noise-contrastive estimation, a conditional 2-D Gaussian-mixture
density, a pre-norm SwiGLU (gated linear unit) network under a KL-divergence label-smoothing loss, an LSTM with
peephole connections timing intervals, a depthwise CNN with squeeze-and-excitation blocks, an encoder transformer
with learned positions adding numbers, and a discrete-time survival model (interval hazards under censoring);
three sequence models (the Mistral, the peephole LSTM and the adding transformer); with and without BatchNorm,
LayerNorm, RMSNorm, GroupNorm or dropout; batches of 8 to 256. Data are drawn by a ``torch.Generator`` from the
seed; every one has label or target noise (or real ambiguity), so the best validation loss stays well above 0.
Validation sets hold at least 256 samples.
"""

from __future__ import annotations

import functools
import math

import torch
from _lr_families import Family, _mlp, _split, _standardised, token_cross_entropy
from _lr_fourth_set import AdagradSupervised, NesterovSupervised, _flip
from _lr_held_out import OptimizerSupervised, _grid
from _lr_problems import Problem, Supervised
from _lr_second_set import RMSpropSupervised, _binary_cross_entropy
from torch import nn


# ---------------------------------------------------------------------------------------------- sequences
class _Mistral(nn.Module):
    """A tiny ``transformers`` Mistral built from its config (2 layers, width 32, 4 query and 2 key-value heads,
    feed-forward 64, a sliding attention window of 6 tokens), returning the next-token logits."""

    def __init__(self, vocab: int, context: int) -> None:
        super().__init__()
        from transformers import MistralConfig, MistralForCausalLM

        self.model = MistralForCausalLM(MistralConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=context, sliding_window=6, bos_token_id=0,
            eos_token_id=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids=x).logits
        return out


def fibonacci_mistral(seed: int) -> Problem:
    """Sequences of 17 tokens from 10: two uniform starting tokens, then each the sum of the two before it modulo
    10, 15 % of tokens then replaced by uniform ones (1,024 sequences, 768 to train); a tiny Hugging Face Mistral
    (``MistralForCausalLM`` from a config) as a next-token LM, Adam, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab = 1024, 17, 10
    seqs = torch.randint(0, vocab, (n, length), generator=g)
    for t in range(2, length):
        seqs[:, t] = (seqs[:, t - 1] + seqs[:, t - 2]) % vocab
    seqs = torch.where(torch.rand(n, length, generator=g) < 0.15, torch.randint(0, vocab, (n, length), generator=g),
                       seqs)
    train, val = _split(seqs[:, :-1], seqs[:, 1:], 768)
    return Problem("modular-Fibonacci Hugging Face Mistral LM (sliding window), Adam",
                   lambda lr: Supervised(_Mistral(vocab, length - 1), token_cross_entropy, "adam", lr), train, val)


class _PeepholeLSTM(nn.Module):
    """An LSTM cell with diagonal peepholes (input and forget gates see the old cell state, the output gate the new
    one), unrolled over the sequence; a linear head on the last hidden state."""

    def __init__(self, features: int, width: int, classes: int) -> None:
        super().__init__()
        self.width = width
        self.gates = nn.Linear(features + width, 4 * width)
        self.peep = nn.Parameter(torch.zeros(3, width))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = x.new_zeros(len(x), self.width)
        for t in range(x.shape[1]):
            i, f, o, z = self.gates(torch.cat([x[:, t], h], 1)).chunk(4, 1)
            c = torch.sigmoid(f + 1 + self.peep[1] * c) * c + torch.sigmoid(i + self.peep[0] * c) * torch.tanh(z)
            h = torch.sigmoid(o + self.peep[2] * c) * torch.tanh(c)
        out: torch.Tensor = self.head(h)
        return out


def interval_peephole_lstm(seed: int) -> Problem:
    """Sequences of 16 steps of background noise (spread 0.3) with two spikes (heights 1.5 to 2.5) a gap of 2, 4, 6
    or 8 steps apart at a random place, a second channel of pure noise; the class is the gap, 5 % of labels redrawn
    (1,280 sequences, 1,024 to train); a peephole LSTM of 32 units, cross-entropy, Adam with AMSGrad, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, steps = 1280, 16
    label = torch.randint(0, 4, (n,), generator=g)
    gap = 2 + 2 * label
    start = (torch.rand(n, generator=g) * (steps - gap)).long()
    x = 0.3 * torch.randn(n, steps, 2, generator=g)
    rows = torch.arange(n)
    x[rows, start, 0] += 1.5 + torch.rand(n, generator=g)
    x[rows, start + gap, 0] += 1.5 + torch.rand(n, generator=g)
    train, val = _split(x, _flip(label, 4, 0.05, g), 1024)
    return Problem("spike-interval peephole LSTM, Adam (AMSGrad)",
                   lambda lr: OptimizerSupervised(_PeepholeLSTM(2, 32, 4), nn.functional.cross_entropy,
                                                  functools.partial(torch.optim.Adam, amsgrad=True), lr),
                   train, val)


class _AddingTransformer(nn.Module):
    """Token plus learned position embeddings (48), a 2-layer pre-norm encoder (4 heads, feed-forward 96), a final
    LayerNorm and a head reading the sum's digits from the first ``digits`` positions."""

    def __init__(self, vocab: int, length: int, digits: int) -> None:
        super().__init__()
        self.digits = digits
        self.embed, self.position = nn.Embedding(vocab, 48), nn.Parameter(0.1 * torch.randn(length, 48))
        layer = nn.TransformerEncoderLayer(48, 4, 96, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(48), nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x) + self.position)
        out: torch.Tensor = self.head(self.norm(h[:, :self.digits]))
        return out


def addition_transformer(seed: int) -> Problem:
    """Two 2-digit numbers written as digit tokens (least significant first) around a "+" token (5 tokens); the
    targets are the sum's 3 digits, least significant first, 10 % of them replaced by uniform digits (2,816 pairs,
    2,560 to train); an encoder transformer with learned positions, cross-entropy per digit, SGD with Nesterov
    momentum 0.9, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 2816
    a, b = torch.randint(0, 100, (n,), generator=g), torch.randint(0, 100, (n,), generator=g)
    powers = torch.tensor([1, 10, 100])
    x = torch.cat([a[:, None] // powers[:2] % 10, torch.full((n, 1), 10), b[:, None] // powers[:2] % 10], 1)
    y = (a + b)[:, None] // powers % 10
    y = torch.where(torch.rand(n, 3, generator=g) < 0.1, torch.randint(0, 10, (n, 3), generator=g), y)
    train, val = _split(x, y, 2560)
    return Problem("two-digit addition transformer (learned positions) + LayerNorm, Nesterov",
                   lambda lr: NesterovSupervised(_AddingTransformer(11, 5, 3), token_cross_entropy, lr), train, val,
                   batch_size=64)


# ---------------------------------------------------------------------------------------------- images and graphs
class _ViT(nn.Module):
    """A tiny ``transformers`` ViT built from its config (8 x 8 single-channel images, patches of 2, 2 layers,
    width 32, 4 heads, feed-forward 64, LayerNorm, weights drawn at spread 0.1 instead of 0.02, which
    barely trains in three epochs), returning the class logits."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64, initializer_range=0.1)
        config.num_labels = classes
        self.model = ViTForImageClassification(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(pixel_values=x).logits
        return out


def stripe_direction_vit(seed: int) -> Problem:
    """8 x 8 images of a +-0.6 texture under pixel noise of spread 1: horizontal stripes, vertical stripes, a
    checkerboard or nothing, each at a random phase; the class is the texture, 8 % of labels redrawn (1,536
    images, 1,024 to train); a tiny Hugging Face ViT (``ViTForImageClassification`` from a config, patches of 2),
    cross-entropy, AdamW, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, size = 1536, 8
    label = torch.randint(0, 4, (n,), generator=g)
    rows, cols = _grid(size)
    shift = torch.randint(0, 2, (n, 1, 1), generator=g)
    sign = 1 - 2 * torch.stack([(rows + shift) % 2 + 0 * cols, (cols + shift) % 2 + 0 * rows,
                                (rows + cols + shift) % 2, torch.full((n, size, size), 0.5)], 1)
    texture = 0.6 * sign[torch.arange(n), label]
    x = (texture + 1.0 * torch.randn(n, size, size, generator=g)).unsqueeze(1)
    train, val = _split(x, _flip(label, 4, 0.08, g), 1024)
    return Problem("stripe-texture Hugging Face ViT + LayerNorm, AdamW",
                   lambda lr: Supervised(_ViT(4), nn.functional.cross_entropy, "adamw", lr), train, val)


class _SqueezeExcite(nn.Module):
    """Squeeze-and-excitation: channel weights in (0, 1) from the channels' means through a bottleneck of 4."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(channels, 4), nn.ReLU(), nn.Linear(4, channels), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights: torch.Tensor = self.gate(x.mean((2, 3)))
        return x * weights[:, :, None, None]


def _se_cnn(channels: int, classes: int) -> nn.Sequential:
    """Conv 3x3 to 16, depthwise 3x3, SE, pointwise to 32, SE (each conv with BatchNorm and ReLU), global average
    pooling and a linear head."""
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), nn.ReLU(), _SqueezeExcite(16),
        nn.Conv2d(16, 32, 1), nn.BatchNorm2d(32), nn.ReLU(), _SqueezeExcite(32),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def blob_channel_se_cnn(seed: int) -> Problem:
    """12 x 12 images of 3 channels under pixel noise of spread 1; one channel holds a Gaussian blob (width 1.5,
    height 0.4 to 1.2, random place) and the class is that channel, 5 % of labels redrawn (1,280 images, 1,024 to
    train); a depthwise CNN with squeeze-and-excitation blocks and BatchNorm, cross-entropy, SGD with momentum 0.9,
    batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, size = 1280, 12
    label = torch.randint(0, 3, (n,), generator=g)
    centre = 2 + 8 * torch.rand(n, 2, generator=g)
    rows, cols = _grid(size)
    blob = torch.exp(-((rows - centre[:, 0, None, None]) ** 2 + (cols - centre[:, 1, None, None]) ** 2) / 4.5)
    height = 0.4 + 0.8 * torch.rand(n, 1, 1, generator=g)
    x = torch.randn(n, 3, size, size, generator=g)
    x[torch.arange(n), label] += height * blob
    train, val = _split(x, _flip(label, 3, 0.05, g), 1024)
    return Problem("blob-channel depthwise CNN with squeeze-and-excitation + BatchNorm, momentum",
                   lambda lr: Supervised(_se_cnn(3, 3), nn.functional.cross_entropy, "momentum", lr), train, val)


class _GraphAttention(nn.Module):
    """Two graph attention layers (2 heads of 16, LeakyReLU additive scores softmaxed over each node's neighbours
    and itself, ELU, LayerNorm), mean- and max-pooled, a linear head. Its input packs, per node, the row of the
    0/1 adjacency (self-loops included) and the node's features."""

    def __init__(self, nodes: int, features: int, heads: int = 2, width: int = 16) -> None:
        super().__init__()
        self.nodes, self.heads, self.width = nodes, heads, width
        self.maps = nn.ModuleList([nn.Linear(features, heads * width), nn.Linear(heads * width, heads * width)])
        self.sources = nn.ParameterList([nn.Parameter(0.1 * torch.randn(heads, width)) for _ in range(2)])
        self.targets = nn.ParameterList([nn.Parameter(0.1 * torch.randn(heads, width)) for _ in range(2)])
        self.norms = nn.ModuleList([nn.LayerNorm(heads * width) for _ in range(2)])
        self.head = nn.Linear(2 * heads * width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adjacency, h = x[..., :self.nodes], x[..., self.nodes:]
        for linear, source, target, norm in zip(self.maps, self.sources, self.targets, self.norms):
            z = linear(h).unflatten(2, (self.heads, self.width))  # (graph, node, head, unit)
            scores = (z * target).sum(3).unsqueeze(2) + (z * source).sum(3).unsqueeze(1)  # (graph, i, j, head)
            scores = nn.functional.leaky_relu(scores, 0.2).masked_fill(adjacency.unsqueeze(3) == 0, -1e9)
            h = norm(nn.functional.elu(torch.einsum("bijh,bjhd->bihd", scores.softmax(2), z).flatten(2)))
        out: torch.Tensor = self.head(torch.cat([h.sum(1) / self.nodes, h.amax(1)], 1))
        return out


def cross_type_gat(seed: int) -> Problem:
    """Random graphs of 10 nodes (edge probability 0.3), each node of type A or B (seen under noise of spread 0.6,
    with 2 more noise features); the label says whether the A-B edges outnumber their expectation given the types
    (their count above 0.3 x #A x #B), 5 % of labels flipped (1,280 graphs, 1,024 to train); a graph attention
    network, binary cross-entropy, NAdam, batch 16."""
    g = torch.Generator().manual_seed(seed)
    n, nodes = 1280, 10
    kind = torch.randint(0, 2, (n, nodes), generator=g).float()
    upper = (torch.rand(n, nodes, nodes, generator=g) < 0.3).float().triu(1)
    edges = upper + upper.transpose(1, 2)
    across = (kind.unsqueeze(1) != kind.unsqueeze(2)).float()
    count = (edges * across).sum((1, 2)) / 2
    label = (count > 0.3 * kind.sum(1) * (nodes - kind.sum(1))).long()
    features = torch.cat([(2 * kind - 1).unsqueeze(2) + 0.6 * torch.randn(n, nodes, 1, generator=g),
                          torch.randn(n, nodes, 2, generator=g)], 2)
    x = torch.cat([edges + torch.eye(nodes), features], 2)
    train, val = _split(x, _flip(label, 2, 0.05, g).float(), 1024)
    return Problem("cross-type-edge graph attention network + LayerNorm, NAdam",
                   lambda lr: OptimizerSupervised(_GraphAttention(nodes, 3), _binary_cross_entropy, torch.optim.NAdam,
                                                  lr), train, val, batch_size=16)


# ---------------------------------------------------------------------------------------------- regression and tabular
class _RBFNetwork(nn.Module):
    """Gaussian radial basis functions with learned centres (started on a grid) and log-widths; a linear read-out."""

    def __init__(self, centres: torch.Tensor) -> None:
        super().__init__()
        self.centres = nn.Parameter(centres.clone())
        self.log_width = nn.Parameter(torch.zeros(len(centres)))
        self.readout = nn.Linear(len(centres), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        distance = ((x.unsqueeze(1) - self.centres) ** 2).sum(2)
        out: torch.Tensor = self.readout(torch.exp(-distance * torch.exp(-2 * self.log_width)))
        return out


def rbf_surface(seed: int) -> Problem:
    """Points uniform on [-3, 3]^2 and a target of sin(a x) cos(b y) + 0.3 x y / 3 with frequencies of the seed's
    own (0.8 to 1.4), under noise of spread 0.3 (2,304 points, 2,048 to train); a radial-basis-function network of
    36 Gaussian units, mean squared error, Adadelta (epsilon 0.1, not its default 1e-6, under which even a
    rate of 1 barely moves it in three epochs), batch 32."""
    g = torch.Generator().manual_seed(seed)
    n = 2304
    x = 6 * torch.rand(n, 2, generator=g) - 3
    a, b = 0.8 + 0.6 * torch.rand(2, generator=g)
    y = torch.sin(a * x[:, 0]) * torch.cos(b * x[:, 1]) + 0.1 * x[:, 0] * x[:, 1] + 0.3 * torch.randn(n, generator=g)
    side = torch.linspace(-2.5, 2.5, 6)
    centres = torch.stack(torch.meshgrid(side, side, indexing="ij"), 2).flatten(0, 1)
    train, val = _split(x, y.unsqueeze(1), 2048)
    return Problem("wavy-surface radial-basis-function network, Adadelta",
                   lambda lr: OptimizerSupervised(_RBFNetwork(centres), nn.functional.mse_loss,
                                                  functools.partial(torch.optim.Adadelta, eps=0.1), lr),
                   train, val)


class _FactorisationMachine(nn.Module):
    """A factorisation machine: a bias, a weight per category, rank-8 factors for the pairwise interactions."""

    def __init__(self, categories: int, rank: int = 8) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1))
        self.weight = nn.Embedding(categories, 1)
        self.factors = nn.Embedding(categories, rank)
        nn.init.zeros_(self.weight.weight)
        nn.init.normal_(self.factors.weight, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.factors(x)  # (row, field, rank)
        pairs = 0.5 * (v.sum(1) ** 2 - (v**2).sum(1)).sum(1)
        out: torch.Tensor = self.bias + self.weight(x).sum((1, 2)) + pairs
        return out.unsqueeze(1)


def click_factorisation_machine(seed: int) -> Problem:
    """Rows of 5 categorical fields (8, 12, 6, 10 and 5 categories, offset into one index space); a click drawn
    from the sigmoid of a random teacher factorisation machine (rank 4, interactions of spread 0.7), so labels are
    Bernoulli noisy (11,264 rows, 10,240 to train); a factorisation machine, binary cross-entropy, Adagrad, batch
    256."""
    g = torch.Generator().manual_seed(seed)
    n, sizes = 11264, torch.tensor([8, 12, 6, 10, 5])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
    x = (torch.rand(n, 5, generator=g) * sizes).long() + offsets
    weight, factors = 0.7 * torch.randn(41, generator=g), 0.9 * torch.randn(41, 4, generator=g)
    v = factors[x]
    logit = weight[x].sum(1) / 2 + 0.5 * (v.sum(1) ** 2 - (v**2).sum(1)).sum(1) - 0.5
    clicks = (torch.rand(n, generator=g) < logit.sigmoid()).float()
    train, val = _split(x, clicks, 10240)
    return Problem("categorical click factorisation machine, Adagrad",
                   lambda lr: AdagradSupervised(_FactorisationMachine(41), _binary_cross_entropy, lr),
                   train, val, batch_size=256)


def _discrete_survival_nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # logits: the hazard logit of each interval; y: the interval of the event or censoring, and whether the event
    # was seen. -log of surviving every interval before it, plus -log h (event) or -log(1 - h) (survived it).
    interval, event = y[:, 0].long(), y[:, 1]
    before = (torch.arange(logits.shape[1]) < interval.unsqueeze(1)).float()
    survive = nn.functional.logsigmoid(-logits)
    last = logits.gather(1, interval.unsqueeze(1)).squeeze(1)
    end = torch.where(event == 1, nn.functional.logsigmoid(last), nn.functional.logsigmoid(-last))
    return -((before * survive).sum(1) + end).mean()


def discrete_time_survival(seed: int) -> Problem:
    """Subjects of 8 Gaussian features whose hazard in each of 8 intervals is the sigmoid of a tanh teacher of the
    features plus a rise over time; the event interval is drawn from those hazards, censored at a uniform interval
    a third of the time (1,024 subjects, 768 to train); MLP 8-64-64-8 with dropout 0.1 giving each interval's hazard
    logit, discrete-time survival negative log-likelihood, plain SGD, batch 8."""
    g = torch.Generator().manual_seed(seed)
    n, intervals = 1024, 8
    x = torch.randn(n, 8, generator=g)
    risk = _standardised(torch.tanh(x @ torch.randn(8, 16, generator=g) / 2) @ torch.randn(16, generator=g))
    hazard = torch.sigmoid(risk.unsqueeze(1) + torch.linspace(-2.5, 0.0, intervals))
    happened = torch.rand(n, intervals, generator=g) < hazard
    happened[:, -1] = True  # administrative end: whoever is left is taken as failing in the last interval
    time = happened.float().argmax(1)
    censored = torch.rand(n, generator=g) < 1 / 3
    censor_time = torch.randint(0, intervals, (n,), generator=g)
    cut = censored & (censor_time < time)
    y = torch.stack([torch.where(cut, censor_time, time).float(), (~cut).float()], 1)
    train, val = _split(x, y, 768)
    return Problem("discrete-time survival MLP + dropout (interval hazards, censored), SGD",
                   lambda lr: Supervised(_mlp(8, 64, 64, intervals, dropout=0.1), _discrete_survival_nll, "sgd", lr),
                   train, val, batch_size=8)


# ---------------------------------------------------------------------------------------------- densities and gates
def _nce_loss(energy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # y: the label (1 data, 0 noise) and log q(x), the noise density. The classifier's logit is log p(x) - log q(x)
    # with the model's unnormalised log-density -E(x) (its normaliser absorbed by the last layer's bias).
    return nn.functional.binary_cross_entropy_with_logits(-energy.squeeze(1) - y[:, 1], y[:, 0])


def ring_nce(seed: int) -> Problem:
    """Data from 8 Gaussians (spread 0.35) on a circle of radius 2 turned by the seed's own angle, against as many
    noise points from N(0, 2^2 I) whose log-density is stored with each point (5,120 points, 4,096 to train); an
    energy MLP 2-64-64-1 (SiLU) fitted by noise-contrastive estimation (logistic loss on log p - log q), RMSprop,
    batch 128."""
    g = torch.Generator().manual_seed(seed)
    n = 5120
    label = (torch.arange(n) % 2).float()[torch.randperm(n, generator=g)]
    turn = 2 * math.pi * torch.rand(1, generator=g)
    angle = turn + 2 * math.pi * torch.randint(0, 8, (n,), generator=g) / 8
    data = 2 * torch.stack([angle.cos(), angle.sin()], 1) + 0.35 * torch.randn(n, 2, generator=g)
    x = torch.where(label.unsqueeze(1) == 1, data, 2 * torch.randn(n, 2, generator=g))
    log_q = -(x**2).sum(1) / 8 - math.log(2 * math.pi * 4)
    train, val = _split(x, torch.stack([label, log_q], 1), 4096)
    return Problem("ring-of-Gaussians energy model (noise-contrastive estimation), RMSprop",
                   lambda lr: RMSpropSupervised(_mlp(2, 64, 64, 1, act=nn.SiLU), _nce_loss, lr), train, val,
                   batch_size=128)


class _GroupNorm4(nn.GroupNorm):
    def __init__(self, channels: int) -> None:
        super().__init__(4, channels)


def _mixture_2d_nll(out: torch.Tensor, y: torch.Tensor, k: int = 4) -> torch.Tensor:
    # out: k mixture logits, k 2-D means, k log-spreads (isotropic). Positive on these data: every component of the
    # data has a spread of at least 0.5, so no density is much above 1 / (2 pi 0.25).
    logits, means = out[:, :k], out[:, k:3 * k].unflatten(1, (k, 2))
    log_sigma = torch.log(0.2 + nn.functional.softplus(out[:, 3 * k:]))
    squared = ((y.unsqueeze(1) - means) ** 2).sum(2)
    log_density = -squared / (2 * torch.exp(2 * log_sigma)) - 2 * log_sigma - math.log(2 * math.pi)
    return -torch.logsumexp(logits.log_softmax(1) + log_density, 1).mean()


def rotating_clusters_density(seed: int) -> Problem:
    """Inputs: an angle phi as (cos phi, sin phi) and 2 noise features; outputs: 2-D points from 3 clusters at
    radius 3 placed 120 degrees apart and turned by 1.5 phi, spreads 0.5, 0.7 and 0.9, weights 0.5, 0.3, 0.2
    (3,328 samples, 3,072 to train); MLP 4-64-64-16 with GroupNorm (4 groups) giving a 4-component isotropic
    Gaussian mixture, negative log-likelihood, Adamax, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 3328
    phi = 2 * math.pi * torch.rand(n, generator=g)
    component = torch.multinomial(torch.tensor([0.5, 0.3, 0.2]), n, replacement=True, generator=g)
    theta = 1.5 * phi + 2 * math.pi * component / 3
    spread = torch.tensor([0.5, 0.7, 0.9])[component].unsqueeze(1)
    y = 3 * torch.stack([theta.cos(), theta.sin()], 1) + spread * torch.randn(n, 2, generator=g)
    x = torch.cat([torch.stack([phi.cos(), phi.sin()], 1), torch.randn(n, 2, generator=g)], 1)
    train, val = _split(x, y, 3072)
    return Problem("rotating-clusters 2-D Gaussian-mixture density MLP + GroupNorm, Adamax",
                   lambda lr: OptimizerSupervised(_mlp(4, 64, 64, 16, norm=_GroupNorm4),
                                                  _mixture_2d_nll, torch.optim.Adamax, lr), train, val,
                   batch_size=64)


class _SwiGLUNet(nn.Module):
    """A linear embedding to 64, two pre-norm residual RMSNorm + SwiGLU (128 wide) blocks, RMSNorm, a linear head."""

    def __init__(self, features: int, classes: int, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.norms = nn.ModuleList([nn.RMSNorm(width) for _ in range(3)])
        self.gates = nn.ModuleList([nn.Linear(width, 4 * width) for _ in range(2)])
        self.downs = nn.ModuleList([nn.Linear(2 * width, width) for _ in range(2)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for norm, gate, down in zip(self.norms, self.gates, self.downs):
            a, b = gate(norm(h)).chunk(2, 1)
            h = h + down(nn.functional.silu(a) * b)
        out: torch.Tensor = self.head(self.norms[2](h))
        return out


def _smoothed_kl(logits: torch.Tensor, y: torch.Tensor, smoothing: float = 0.1) -> torch.Tensor:
    # KL(smoothed one-hot || softmax): 1 - smoothing on the label, the rest spread evenly over the classes.
    classes = logits.shape[1]
    target = nn.functional.one_hot(y, classes).float() * (1 - smoothing) + smoothing / classes
    return nn.functional.kl_div(logits.log_softmax(1), target, reduction="batchmean")


def swiglu_label_smoothing(seed: int) -> Problem:
    """10 classes from 20 Gaussian features by the argmax of a random two-layer tanh teacher, 10 % of labels
    redrawn (5,632 samples, 5,120 to train); a pre-norm SwiGLU network with RMSNorm, KL divergence to labels
    smoothed by 0.1, RAdam, batch 128."""
    g = torch.Generator().manual_seed(seed)
    n = 5632
    x = torch.randn(n, 20, generator=g)
    teacher = torch.tanh(x @ torch.randn(20, 32, generator=g) / 3) @ torch.randn(32, 10, generator=g)
    train, val = _split(x, _flip(teacher.argmax(1), 10, 0.1, g), 5120)
    return Problem("teacher-argmax SwiGLU network + RMSNorm (KL label smoothing), RAdam",
                   lambda lr: OptimizerSupervised(_SwiGLUNet(20, 10), _smoothed_kl, torch.optim.RAdam, lr), train,
                   val, batch_size=128)


ELEVENTH_SET: list[Family] = [fibonacci_mistral, interval_peephole_lstm, addition_transformer, stripe_direction_vit,
                              blob_channel_se_cnn, cross_type_gat, rbf_surface, click_factorisation_machine,
                              discrete_time_survival, ring_nce, rotating_clusters_density, swiglu_label_smoothing]
