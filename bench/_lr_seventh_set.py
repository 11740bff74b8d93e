"""The seventh set of LR-finder problem families, ``SEVENTH_SET`` (12), the held-out half: written on 2026-11-29,
after the sixth set, by someone who never ran the LR finder on them nor saw any of its results or logs. Only plain
fits on the learning-rate grid (and the initial loss) were run on them while they were written, to check that each
trains, that its best loss stays well above 0, that its best learning rate lies inside the grid for most seeds and
that a fit is cheap; never the LR finder.

None repeats an earlier family's data, model and optimizer. Between them: Adam (1), Adam with AMSGrad (1), AdamW
(1), plain SGD (2), SGD with momentum 0.9 (1, and 1 more with weight decay), SGD with Nesterov momentum 0.9 (1),
Adamax (1), NAdam (1), RMSprop (1) and RAdam (1); binary (class-weighted and per-position), multi-class and
language-identification classification, regression (Huber loss on heavy-tailed noise, a Poisson count, a Gaussian
likelihood per step of a series and a mixture-density head on a multi-valued inverse problem), a causal character
LM on words from a syllable grammar, a triplet-loss metric embedding and a convolutional denoising autoencoder;
four sequence models (a two-layer LSTM LM, a bidirectional GRU, a GRU forecaster and a transformer encoder
tagger), three small CNNs on synthetic images (one residual with GroupNorm); with and without BatchNorm,
LayerNorm, GroupNorm, dropout or weight decay; batches of 8 to 256. Data are drawn by a ``torch.Generator`` or by
scikit-learn's generators, all from the seed; every one has label or target noise (or real ambiguity), so the best
validation loss stays well above 0. Validation sets hold at least 256 samples.
"""

from __future__ import annotations

import functools
import math

import torch
from _lr_families import Family, _mlp, _split, _standardised, token_cross_entropy
from _lr_fourth_set import NesterovSupervised, _flip, _gaussian_nll, _Residual
from _lr_held_out import OptimizerSupervised, _grid
from _lr_problems import Problem, Supervised
from _lr_second_set import _binary_cross_entropy, _poisson_nll, _tensor
from torch import nn
from torch.utils.data import TensorDataset

import phalanx


# ---------------------------------------------------------------------------------------------- sequences
class _StackedLSTMLM(nn.Module):
    """Embedding 24, a two-layer LSTM of 48 units with dropout 0.2 between its layers, a linear head."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 24)
        self.rnn = nn.LSTM(24, 48, num_layers=2, dropout=0.2, batch_first=True)
        self.head = nn.Linear(48, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(x))
        out: torch.Tensor = self.head(hidden)
        return out


def syllable_lstm_lm(seed: int) -> Problem:
    """Words of 1 to 3 syllables (onset, vowel, optional coda, each drawn from skewed frequencies of the seed's
    own) joined by spaces into one character stream; windows of 24 characters to predict the next one (768
    training windows from the first 80 % of the stream, 256 validation windows from the rest); a two-layer
    LSTM LM with dropout, Adam, batch 32."""
    g = torch.Generator().manual_seed(seed)
    onsets, vowels, codas = [*"bdfghklmnprstvwz", ""], list("aeiou"), ["", "", "n", "r", "s", "l", "k"]
    chars = sorted(set("".join(onsets + vowels + codas)) | {" "})

    def draw(options: list[str], count: int) -> list[str]:
        probs = (1.5 * torch.randn(len(options), generator=g)).softmax(0)
        return [options[i] for i in torch.multinomial(probs, count, replacement=True, generator=g).tolist()]

    count = 6000
    syllables = [a + b + c for a, b, c in zip(draw(onsets, count), draw(vowels, count), draw(codas, count),
                                              strict=True)]
    lengths = torch.multinomial(torch.tensor([0.3, 0.5, 0.2]), count, replacement=True, generator=g) + 1
    words, at = [], 0
    for length in lengths.tolist():
        if at + length > count:
            break
        words.append("".join(syllables[at:at + length]))
        at += length
    stream = torch.tensor([chars.index(c) for c in " ".join(words)])
    cut = int(0.8 * len(stream))

    def windows(source: torch.Tensor, n: int) -> TensorDataset:
        starts = torch.randint(0, len(source) - 25, (n, 1), generator=g) + torch.arange(25)
        return TensorDataset(source[starts[:, :-1]], source[starts[:, 1:]])

    return Problem("syllable-grammar two-layer LSTM char LM + dropout, Adam",
                   lambda lr: Supervised(_StackedLSTMLM(len(chars)), token_cross_entropy, "adam", lr),
                   windows(stream[:cut], 768), windows(stream[cut:], 256))


class _PooledBiGRU(nn.Module):
    """Embedding 16, a bidirectional GRU of 32 units each way, max-pooled over positions, a linear head."""

    def __init__(self, vocab: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.rnn = nn.GRU(16, 32, batch_first=True, bidirectional=True)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(x))
        out: torch.Tensor = self.head(hidden.amax(1))
        return out


def language_id_bigru(seed: int) -> Problem:
    """Strings of 16 characters from 16, each from one of 4 "languages" (the class): first-order Markov chains
    sharing most of their transition preferences, 5 % of labels redrawn (1,024 strings, 768 to train); a
    bidirectional GRU, max-pooled, cross-entropy, SGD with momentum 0.9, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab, languages = 1024, 16, 16, 4
    base = 2 * torch.randn(1, vocab, vocab, generator=g)
    probs = (base + 1.2 * torch.randn(languages, vocab, vocab, generator=g)).softmax(-1)
    label = torch.randint(0, languages, (n,), generator=g)
    tokens = torch.empty(n, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, length):
        tokens[:, t] = torch.multinomial(probs[label, tokens[:, t - 1]], 1, generator=g).squeeze(1)
    train, val = _split(tokens, _flip(label, languages, 0.05, g), 768)
    return Problem("language-ID bidirectional GRU, momentum",
                   lambda lr: Supervised(_PooledBiGRU(vocab, languages), nn.functional.cross_entropy, "momentum",
                                         lr), train, val)


class _TaggingEncoder(nn.Module):
    """Embedding 32 (no positions), one post-LayerNorm transformer block (4 heads, feed-forward 64, dropout 0.1),
    a logit per position."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(self.embed(x)))
        return out


def duplicate_transformer(seed: int) -> Problem:
    """Sequences of 16 tokens from 24, each position tagged by whether its token occurs elsewhere in the sequence,
    5 % of tags flipped (1,280 sequences, 1,024 to train); a one-block transformer encoder tagger with dropout,
    binary cross-entropy per position, Adam with AMSGrad, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab = 1280, 16, 24
    tokens = torch.randint(0, vocab, (n, length), generator=g)
    repeated = (tokens.unsqueeze(1) == tokens.unsqueeze(2)).sum(2) > 1
    noisy = torch.rand(n, length, generator=g) < 0.05
    train, val = _split(tokens, (repeated ^ noisy).float(), 1024)
    amsgrad = functools.partial(torch.optim.Adam, amsgrad=True)
    return Problem("duplicate-token transformer tagger + dropout, Adam (AMSGrad)",
                   lambda lr: OptimizerSupervised(_TaggingEncoder(vocab), _binary_cross_entropy, amsgrad, lr),
                   train, val, batch_size=64)


class _Forecaster(nn.Module):
    """A GRU of 32 units over a scalar series giving, at every step, the next value's mean and log-spread."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(1, 32, batch_first=True)
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(x)
        out: torch.Tensor = self.head(hidden)
        return out


def _sequence_gaussian_nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _gaussian_nll(out.flatten(0, 1), y.flatten(0, 1))


def volatility_gru(seed: int) -> Problem:
    """Series of 32 returns from an AR(1) mean (coefficient 0.6) with GARCH(1,1) noise whose persistence (0.9 to
    0.98) and reaction (0.2 to 0.4) are the series' own, standardised (1,024 series after a burn-in of 16 steps,
    768 to train); a GRU forecasting each next return's mean and log-spread, Gaussian negative log-likelihood,
    Adamax, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, burn_in = 1024, 33, 16
    reaction = 0.2 + 0.2 * torch.rand(n, generator=g)
    persistence = 0.9 + 0.08 * torch.rand(n, generator=g)
    variance, value, noise = torch.ones(n), torch.zeros(n), torch.zeros(n)
    series = torch.empty(n, length)
    for t in range(burn_in + length):
        variance = (1 - persistence) + reaction * noise**2 + (persistence - reaction) * variance
        noise = variance.sqrt() * torch.randn(n, generator=g)
        value = 0.6 * value + noise
        if t >= burn_in:
            series[:, t - burn_in] = value
    series = (series / series.std()).unsqueeze(2)
    train, val = _split(series[:, :-1], series[:, 1:], 768)
    return Problem("GARCH-volatility GRU forecaster (Gaussian likelihood), Adamax",
                   lambda lr: OptimizerSupervised(_Forecaster(), _sequence_gaussian_nll, torch.optim.Adamax, lr),
                   train, val)


# ---------------------------------------------------------------------------------------------- images
class _GroupNormResNet(_Residual):
    """A 3x3 convolution of 16 channels and max pooling, two residual blocks (GroupNorm, ReLU, 3x3 convolution),
    then GroupNorm, ReLU, global average pooling and a linear head."""

    def __init__(self, classes: int) -> None:
        super().__init__(nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.MaxPool2d(2)),
                         [nn.Sequential(nn.GroupNorm(4, 16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
                          for _ in range(2)],
                         nn.Sequential(nn.GroupNorm(4, 16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                       nn.Linear(16, classes)))


def roughness_resnet(seed: int) -> Problem:
    """16x16 textures of low-pass filtered Gaussian noise whose cut-off frequency (0.08, 0.15 or 0.28 cycles per
    pixel, the class) is jittered by a factor of exp(0.25 N(0, 1)) per image, standardised, under pixel noise of
    spread 0.5 (2,048 images, 1,536 to train); a residual CNN with GroupNorm, cross-entropy, SGD with momentum
    0.9 and weight decay 5e-4, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 2048
    label = torch.randint(0, 3, (n,), generator=g)
    cutoff = torch.tensor([0.08, 0.15, 0.28])[label] * (0.25 * torch.randn(n, generator=g)).exp()
    freq = torch.fft.fftfreq(16)
    radius = (freq.view(-1, 1) ** 2 + freq.view(1, -1) ** 2).sqrt()
    spectrum = torch.fft.fft2(torch.randn(n, 16, 16, generator=g)) * (-(radius / cutoff.view(n, 1, 1)) ** 2).exp()
    texture = torch.fft.ifft2(spectrum).real
    texture = (texture - texture.mean((1, 2), keepdim=True)) / texture.std((1, 2), keepdim=True)
    image = texture + 0.5 * torch.randn(n, 16, 16, generator=g)
    train, val = _split(image.unsqueeze(1), label, 1536)
    optimizer = functools.partial(torch.optim.SGD, momentum=0.9, weight_decay=5e-4)
    return Problem("texture-roughness residual CNN + GroupNorm, momentum + weight decay",
                   lambda lr: OptimizerSupervised(_GroupNormResNet(3), nn.functional.cross_entropy, optimizer, lr),
                   train, val, batch_size=64)


def dot_count_poisson(seed: int) -> Problem:
    """12x12 images of a Poisson(3) number of Gaussian dots (spread 0.8 pixels, random brightness; up to 9, at
    random, possibly overlapping places) under pixel noise of spread 0.4, the count the target (2,048 images,
    1,536 to train); a CNN of two 3x3 convolutions and global average pooling giving a log-rate, Poisson negative
    log-likelihood, NAdam, batch 128."""
    g = torch.Generator().manual_seed(seed)
    n, slots = 2048, 9
    count = torch.poisson(torch.full((n,), 3.0), generator=g).clamp(max=slots)
    place = 1 + 10 * torch.rand(n, slots, 2, 1, 1, generator=g)
    rows, cols = _grid(12)
    dist2 = (rows - place[:, :, 0]) ** 2 + (cols - place[:, :, 1]) ** 2
    weight = (torch.arange(slots) < count.unsqueeze(1)) * (0.7 + 0.6 * torch.rand(n, slots, generator=g))
    image = (weight.view(n, slots, 1, 1) * (-dist2 / (2 * 0.8**2)).exp()).sum(1)
    image = image + 0.4 * torch.randn(n, 12, 12, generator=g)
    train, val = _split(image.unsqueeze(1), count.unsqueeze(1), 1536)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1))
        return OptimizerSupervised(net, _poisson_nll, torch.optim.NAdam, lr)

    return Problem("dot-count CNN (Poisson likelihood), NAdam", make, train, val, batch_size=128)


def blob_denoising_autoencoder(seed: int) -> Problem:
    """16x16 images of 3 Gaussian blobs of random place, width (1.5 to 3 pixels) and signed amplitude, seen under
    pixel noise of spread 0.6 and reconstructed clean (1,536 images, 1,280 to train); a convolutional autoencoder
    (two stride-2 convolutions, two transposed ones), L1 loss, AdamW, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n = 1536
    place = 2 + 12 * torch.rand(n, 3, 2, 1, 1, generator=g)
    width = 1.5 + 1.5 * torch.rand(n, 3, 1, 1, generator=g)
    amplitude = torch.randn(n, 3, 1, 1, generator=g)
    rows, cols = _grid(16)
    dist2 = (rows - place[:, :, 0]) ** 2 + (cols - place[:, :, 1]) ** 2
    clean = (amplitude * (-dist2 / (2 * width**2)).exp()).sum(1, keepdim=True)
    train, val = _split(clean + 0.6 * torch.randn(n, 1, 16, 16, generator=g), clean, 1280)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.ReLU(),
                            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                            nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.ReLU(),
                            nn.ConvTranspose2d(16, 1, 4, stride=2, padding=1))
        return Supervised(net, nn.functional.l1_loss, "adamw", lr)

    return Problem("blob denoising conv autoencoder (L1 loss), AdamW", make, train, val, batch_size=32)


# ---------------------------------------------------------------------------------------------- tabular
class _TripletEmbedding(nn.Module):
    """One MLP (24-64-64-16 with LayerNorm) embedding the anchor, positive and negative of each triplet."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp(24, 64, 64, 16, norm=nn.LayerNorm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def _triplet_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.triplet_margin_loss(out[:, 0], out[:, 1], out[:, 2], margin=1.0)


def identity_triplets(seed: int) -> Problem:
    """Triplets (anchor, another sample of its identity, a sample of another) of 16 identities: overlapping
    Gaussian clusters in 12-D (centres of spread 1, samples of spread 0.8) seen through a fixed random tanh layer
    of 24 features (2,048 triplets to train, 512 to validate); an MLP embedding with LayerNorm, triplet margin loss
    (margin 1), SGD with Nesterov momentum 0.9, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n, identities = 2560, 16
    centres, mixing = torch.randn(identities, 12, generator=g), torch.randn(12, 24, generator=g) / math.sqrt(12)
    anchor = torch.randint(0, identities, (n,), generator=g)
    other = (anchor + torch.randint(1, identities, (n,), generator=g)) % identities
    who = torch.stack([anchor, anchor, other], 1)
    x = torch.tanh((centres[who] + 0.8 * torch.randn(n, 3, 12, generator=g)) @ mixing)
    train, val = _split(x, torch.zeros(n), 2048)
    return Problem("identity-triplet metric embedding + LayerNorm, Nesterov",
                   lambda lr: NesterovSupervised(_TripletEmbedding(), _triplet_loss, lr), train, val, batch_size=64)


def _mixture_nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # The whole negative log-likelihood of a Gaussian mixture (log(2 pi)/2 included).
    logits, mean, log_sd = out.chunk(3, 1)
    log_density = -log_sd - 0.5 * ((y - mean) / log_sd.exp()) ** 2 - 0.5 * math.log(2 * math.pi)
    return -(logits.log_softmax(1) + log_density).logsumexp(1).mean()


def inverse_sine_mdn(seed: int) -> Problem:
    """Bishop's inverse problem: t uniform on [0, 1], x = t + 0.3 sin(2 pi t) + uniform noise on [-0.1, 0.1], t
    (plus noise of spread 0.05) predicted from x, where it has up to three branches (both standardised; 2,048
    samples, 1,536 to train); a tanh MLP 1-64-64-9 as a mixture-density head of 3 Gaussians, their negative
    log-likelihood, RMSprop, batch 128."""
    g = torch.Generator().manual_seed(seed)
    n = 2048
    t = torch.rand(n, 1, generator=g)
    x = t + 0.3 * torch.sin(2 * math.pi * t) + 0.2 * (torch.rand(n, 1, generator=g) - 0.5)
    train, val = _split(_standardised(x), _standardised(t + 0.05 * torch.randn(n, 1, generator=g)), 1536)
    return Problem("inverse-sine mixture-density MLP, RMSprop",
                   lambda lr: OptimizerSupervised(_mlp(1, 64, 64, 9, act=nn.Tanh), _mixture_nll,
                                                  torch.optim.RMSprop, lr), train, val, batch_size=128)


def _weighted_binary_cross_entropy(logits: torch.Tensor, y: torch.Tensor, positive_weight: float) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits.squeeze(1), y,
                                                          pos_weight=torch.tensor(positive_weight))


def imbalanced_weighted(seed: int) -> Problem:
    """sklearn's make_classification with 15 % positives (20 features, 6 informative, 4 redundant, class
    separation 0.8, 5 % of labels redrawn; 8,192 samples, 7,680 to train); MLP 20-64-64-1 with BatchNorm and
    dropout 0.2, binary cross-entropy weighting the positives by 85/15, RAdam, batch 256."""
    from sklearn.datasets import make_classification

    x, y = make_classification(8192, n_features=20, n_informative=6, n_redundant=4, weights=[0.85], flip_y=0.05,
                               class_sep=0.8, random_state=seed)
    train, val = _split(_standardised(_tensor(x)), _tensor(y), 7680)
    loss = functools.partial(_weighted_binary_cross_entropy, positive_weight=85 / 15)

    def make(lr: float) -> phalanx.Module:
        net = _mlp(20, 64, 64, 1, norm=nn.BatchNorm1d, dropout=0.2)
        return OptimizerSupervised(net, loss, torch.optim.RAdam, lr)

    return Problem("imbalanced class-weighted MLP + BatchNorm + dropout, RAdam", make, train, val,
                   batch_size=256)


def heavy_tailed_huber(seed: int) -> Problem:
    """y = x.w + sin(x.v) + x0 x1 / 2 from 6 Gaussian features (standardised), plus Student-t noise (2 degrees of
    freedom) of scale 0.5 (1,024 samples, 768 to train); MLP 6-64-64-1 with LayerNorm and dropout 0.1, Huber loss,
    plain SGD, batch 8."""
    g = torch.Generator().manual_seed(seed)
    n = 1024
    x = torch.randn(n, 6, generator=g)
    w, v = torch.randn(6, 1, generator=g) / 2, torch.randn(6, 1, generator=g)
    clean = _standardised(x @ w + torch.sin(x @ v) + x[:, :1] * x[:, 1:2] / 2)
    noise = torch.randn(n, 1, generator=g) / (torch.randn(n, 2, generator=g).pow(2).mean(1, keepdim=True)).sqrt()
    train, val = _split(x, clean + 0.5 * noise, 768)

    def make(lr: float) -> phalanx.Module:
        net = _mlp(6, 64, 64, 1, norm=nn.LayerNorm, dropout=0.1)
        return Supervised(net, nn.functional.huber_loss, "sgd", lr)

    return Problem("heavy-tailed regression MLP + LayerNorm + dropout (Huber loss), SGD", make, train, val,
                   batch_size=8)


def s_curve_segments(seed: int) -> Problem:
    """sklearn's S-curve in 3-D with noise 0.3 (standardised), classified by which sixth of the curve (by
    position along it) a point was drawn from (3,072 points, 2,560 to train); MLP 3-64-64-6 with BatchNorm,
    cross-entropy, plain SGD, batch 128."""
    from sklearn.datasets import make_s_curve

    x, t = make_s_curve(3072, noise=0.3, random_state=seed)
    position = _tensor(t)
    segment = torch.bucketize(position, position.quantile(torch.linspace(0, 1, 7)[1:-1]))
    train, val = _split(_standardised(_tensor(x)), segment, 2560)

    def make(lr: float) -> phalanx.Module:
        return Supervised(_mlp(3, 64, 64, 6, norm=nn.BatchNorm1d), nn.functional.cross_entropy, "sgd", lr)

    return Problem("S-curve segments MLP + BatchNorm, SGD", make, train, val, batch_size=128)


SEVENTH_SET: list[Family] = [syllable_lstm_lm, language_id_bigru, duplicate_transformer, volatility_gru,
                             roughness_resnet, dot_count_poisson, blob_denoising_autoencoder, identity_triplets,
                             inverse_sine_mdn, imbalanced_weighted, heavy_tailed_huber, s_curve_segments]
