"""The sixth set of LR-finder problem families, ``SIXTH_SET`` (12), in the tuning half since its first score chose a
change of the rule (the decade lower); written on 2026-11-29, after the suggestion rule was last changed, by
someone who never ran the LR finder on them nor saw any of its results or logs. Only plain fits on the
learning-rate grid (and the initial loss) were run on them while they were written, to check that each trains,
that its best loss stays well above 0, that its best learning rate lies inside the grid for most seeds and that a
fit is cheap; never the LR finder.

None repeats an earlier family's data, model and optimizer. Between them: AdamW (2), Adam (1), plain SGD (2),
SGD with momentum 0.9 and weight decay (1), SGD with Nesterov momentum 0.9 (1), RMSprop (1), Adagrad (1),
NAdam (1), RAdam (1) and Adamax (1); binary, multi-class, multi-label and ordinal classification, regression
(squared error, Huber and L1 losses), two tiny Hugging Face ``transformers`` models built from a config (a
GPT-2 causal LM and a BERT classifier; no download), a CBOW word-embedding model, two small CNNs on
synthetic images, a text CNN, a 1-D CNN on signals, an LSTM on time series and a small transformer encoder;
with and without BatchNorm, LayerNorm or dropout; batches of 8 to 256. Data are drawn by a
``torch.Generator`` or by scikit-learn's generators, all from the seed; every one has label or target noise
(or real ambiguity), so the best validation loss stays well above 0. Validation sets hold at least 256
samples.
"""

from __future__ import annotations

import functools
import math

import torch
from _lr_families import Family, _mlp, _split, _standardised, token_cross_entropy
from _lr_fourth_set import NesterovSupervised, _flip
from _lr_held_out import OptimizerSupervised
from _lr_problems import Problem, Supervised
from _lr_second_set import _binary_cross_entropy, _multilabel_cross_entropy, _tensor
from torch import nn

import phalanx


# ---------------------------------------------------------------------------------------------- Hugging Face
class _GPT2(nn.Module):
    """A tiny ``transformers`` GPT-2 built from its config (2 layers, width 32, 2 heads, its default dropout of
    0.1), returning the next-token logits."""

    def __init__(self, vocab: int, context: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=context, n_embd=32, n_layer=2,
                                                n_head=2, bos_token_id=0, eos_token_id=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids=x).logits
        return out


def gpt2_progressions(seed: int) -> Problem:
    """Sequences of 16 tokens counting modulo 16 from a random start by a step of their own (1, 2, 3 or 5), each
    token replaced by a uniformly drawn one with probability 0.15 (1,280 sequences, 1,024 to train); a tiny
    Hugging Face GPT-2 (``GPT2LMHeadModel`` from a config) as a next-token LM, AdamW, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab = 1280, 17, 16
    start = torch.randint(0, vocab, (n, 1), generator=g)
    step = torch.tensor([1, 2, 3, 5])[torch.randint(0, 4, (n, 1), generator=g)]
    seqs = (start + step * torch.arange(length)) % vocab
    seqs = torch.where(torch.rand(n, length, generator=g) < 0.15, torch.randint(0, vocab, (n, length), generator=g),
                       seqs)
    train, val = _split(seqs[:, :-1], seqs[:, 1:], 1024)
    return Problem("noisy progressions Hugging Face GPT-2 LM, AdamW",
                   lambda lr: Supervised(_GPT2(vocab, length - 1), token_cross_entropy, "adamw", lr), train, val)


class _Bert(nn.Module):
    """A tiny ``transformers`` BERT sequence classifier built from its config (2 layers, width 32, 2 heads,
    feed-forward 64, its default dropout of 0.1), returning the class logits."""

    def __init__(self, vocab: int, context: int, classes: int) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=context)
        config.num_labels = classes
        self.model = BertForSequenceClassification(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids=x).logits
        return out


def bert_marker_count(seed: int) -> Problem:
    """Sequences of a [CLS] token then 16 tokens, each one of two marker tokens with probability 0.2 apiece and
    otherwise one of 14 filler ones, labelled by which marker occurs more often (ties drawn at random), 5 % of
    labels redrawn (1,280 sequences, 1,024 to train); a tiny Hugging Face BERT (``BertForSequenceClassification``
    from a config), AdamW, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab = 1280, 16, 17  # token 0 is [CLS], 1 and 2 the markers
    u = torch.rand(n, length, generator=g)
    tokens = torch.where(u < 0.2, 1, torch.where(u < 0.4, 2, torch.randint(3, vocab, (n, length), generator=g)))
    lead = (tokens == 1).sum(1) - (tokens == 2).sum(1) + 0.5 * (torch.rand(n, generator=g) - 0.5)
    label = _flip((lead > 0).long(), 2, 0.05, g)
    x = torch.cat([torch.zeros(n, 1, dtype=torch.long), tokens], 1)
    train, val = _split(x, label, 1024)
    return Problem("marker-count Hugging Face BERT classifier, AdamW",
                   lambda lr: Supervised(_Bert(vocab, length + 1, 2), nn.functional.cross_entropy, "adamw", lr),
                   train, val)


# ---------------------------------------------------------------------------------------------- images
def spot_huber_cnn(seed: int) -> Problem:
    """16x16 images of one Gaussian spot (spread 1.5 pixels, random brightness) at a random place under pixel
    noise, its row and column (standardised, jittered by 0.1) the target (2,048 images, 1,536 to train); a CNN of
    two 3x3 convolutions with max pooling and a linear head, Huber loss, RMSprop, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 2048
    place = 2 + 12 * torch.rand(n, 2, generator=g)
    coords = torch.arange(16, dtype=torch.float32)
    rows, cols = coords.view(1, -1, 1), coords.view(1, 1, -1)
    dist2 = (rows - place[:, 0].view(n, 1, 1)) ** 2 + (cols - place[:, 1].view(n, 1, 1)) ** 2
    brightness = (0.5 + torch.rand(n, generator=g)).view(n, 1, 1)
    image = brightness * torch.exp(-dist2 / (2 * 1.5**2)) + 0.5 * torch.randn(n, 16, 16, generator=g)
    target = (place - 8) / 3.5 + 0.1 * torch.randn(n, 2, generator=g)
    train, val = _split(image.unsqueeze(1), target, 1536)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), nn.Linear(512, 2))
        return OptimizerSupervised(net, nn.functional.huber_loss, torch.optim.RMSprop, lr)

    return Problem("spot-localisation CNN (Huber loss), RMSprop", make, train, val, batch_size=64)


class _MirrorCNN(nn.Module):
    """A CNN given an image and its left-right mirror as two channels: two 3x3 convolutions with BatchNorm,
    global average pooling and a linear head (one logit)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(2, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(torch.cat([x, x.flip(-1)], 1))
        return out


def symmetry_cnn_bn(seed: int) -> Problem:
    """10x10 images of Gaussian pixels whose right half mirrors the left (or is drawn afresh), under pixel noise of
    spread 1, 5 % of labels redrawn (2,048 images, 1,536 to train); a CNN with BatchNorm seeing the image and its
    mirror, binary cross-entropy, SGD with Nesterov momentum 0.9, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n = 2048
    left = torch.randn(n, 10, 5, generator=g)
    symmetric = torch.rand(n, generator=g) < 0.5
    right = torch.where(symmetric.view(n, 1, 1), left.flip(-1), torch.randn(n, 10, 5, generator=g))
    image = torch.cat([left, right], 2) + torch.randn(n, 10, 10, generator=g)
    train, val = _split(image.unsqueeze(1), _flip(symmetric.long(), 2, 0.05, g).float(), 1536)
    return Problem("mirror-symmetry CNN + BatchNorm, Nesterov",
                   lambda lr: NesterovSupervised(_MirrorCNN(), _binary_cross_entropy, lr), train, val)


# ---------------------------------------------------------------------------------------------- sequences
class _TextCNN(nn.Module):
    """Embedding 24, a width-3 convolution of 64 filters, max-pooled over positions, dropout 0.3, a linear head."""

    def __init__(self, vocab: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 24)
        self.net = nn.Sequential(nn.Conv1d(24, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool1d(1), nn.Flatten(),
                                 nn.Dropout(0.3), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(self.embed(x).transpose(1, 2))
        return out


def trigram_textcnn(seed: int) -> Problem:
    """Sequences of 32 tokens from 40 in which one of the 2 trigrams of their class (of 4) is planted once, each
    planted token mutated with probability 0.2, 10 % of labels redrawn (2,048 sequences, 1,536 to train); a text
    CNN with dropout, Adagrad, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab = 2048, 32, 40
    trigrams = torch.randint(0, vocab, (4, 2, 3), generator=g)
    label = torch.randint(0, 4, (n,), generator=g)
    planted = trigrams[label, torch.randint(0, 2, (n,), generator=g)]
    planted = torch.where(torch.rand(n, 3, generator=g) < 0.2, torch.randint(0, vocab, (n, 3), generator=g), planted)
    tokens = torch.randint(0, vocab, (n, length), generator=g)
    start = torch.randint(0, length - 2, (n, 1), generator=g)
    tokens.scatter_(1, start + torch.arange(3), planted)
    train, val = _split(tokens, _flip(label, 4, 0.1, g), 1536)
    return Problem("planted-trigram text CNN + dropout, Adagrad",
                   lambda lr: OptimizerSupervised(_TextCNN(vocab, 4), nn.functional.cross_entropy, torch.optim.Adagrad,
                                                  lr), train, val)


class _LastLSTM(nn.Module):
    """An LSTM of 32 units over a scalar series, classified from its last hidden state."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(1, 32, batch_first=True)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (last, _) = self.rnn(x)
        out: torch.Tensor = self.head(last[-1])
        return out


def ar_coefficient_lstm(seed: int) -> Problem:
    """Series of 24 steps from an AR(1) process whose coefficient (-0.7, 0 or 0.7) is the class, observed under
    noise of spread 0.5 (1,280 series, 1,024 to train); an LSTM classifying from its last state, NAdam, batch 16."""
    g = torch.Generator().manual_seed(seed)
    n, length = 1280, 24
    label = torch.randint(0, 3, (n,), generator=g)
    phi = 0.7 * (label.float() - 1)
    series = torch.zeros(n, length)
    series[:, 0] = torch.randn(n, generator=g) / (1 - phi**2).sqrt()
    for t in range(1, length):
        series[:, t] = phi * series[:, t - 1] + torch.randn(n, generator=g)
    series = series + 0.5 * torch.randn(n, length, generator=g)
    train, val = _split((series / series.std()).unsqueeze(2), label, 1024)
    return Problem("AR-coefficient LSTM classifier, NAdam",
                   lambda lr: OptimizerSupervised(_LastLSTM(3), nn.functional.cross_entropy, torch.optim.NAdam, lr),
                   train, val, batch_size=16)


class _PooledEncoder(nn.Module):
    """One pre-LayerNorm transformer block (width 32, 4 heads, no dropout), mean-pooled, then a linear head."""

    def __init__(self, vocab: int, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(self.embed(x)).mean(1))
        return out


def distinct_count_transformer(seed: int) -> Problem:
    """Sequences of 16 tokens from 12, the number of distinct tokens (standardised) plus noise of spread 0.3 the
    target (2,048 sequences, 1,536 to train); a one-block transformer encoder, mean squared error, RAdam, batch
    64."""
    g = torch.Generator().manual_seed(seed)
    n = 2048
    tokens = torch.randint(0, 12, (n, 16), generator=g)
    distinct = nn.functional.one_hot(tokens, 12).amax(1).sum(1).float()
    target = _standardised(distinct.unsqueeze(1)) + 0.3 * torch.randn(n, 1, generator=g)
    train, val = _split(tokens, target, 1536)
    return Problem("distinct-token-count transformer encoder, RAdam",
                   lambda lr: OptimizerSupervised(_PooledEncoder(12), nn.functional.mse_loss, torch.optim.RAdam, lr),
                   train, val, batch_size=64)


def cbow_sgd(seed: int) -> Problem:
    """CBOW windows over a token stream from a random first-order Markov chain over 48 symbols (4 likely
    successors each): the middle token predicted from the 2 on each side (4,096 windows, 3,072 to train); a
    summing EmbeddingBag of 32 and a linear layer over the vocabulary, plain SGD, batch 32."""
    g = torch.Generator().manual_seed(seed)
    vocab, n = 48, 4096
    logits = torch.full((vocab, vocab), -3.0)
    logits.scatter_(1, torch.rand(vocab, vocab, generator=g).argsort(1)[:, :4], 2 * torch.rand(vocab, 4, generator=g))
    probs = logits.softmax(1)
    stream = torch.empty(n + 4, dtype=torch.long)
    stream[0] = int(torch.randint(0, vocab, (1,), generator=g))
    for t in range(1, n + 4):
        stream[t] = torch.multinomial(probs[stream[t - 1]], 1, generator=g)
    windows = stream.unfold(0, 5, 1)[:n]
    train, val = _split(windows[:, [0, 1, 3, 4]], windows[:, 2], 3072)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.EmbeddingBag(vocab, 32, mode="sum"), nn.Linear(32, vocab))
        return Supervised(net, nn.functional.cross_entropy, "sgd", lr)

    return Problem("Markov-stream CBOW embeddings, SGD", make, train, val)


def frequency_conv1d_bn(seed: int) -> Problem:
    """Noisy sinusoids of 64 samples with a random frequency (2 to 8 cycles), amplitude and phase under noise of
    spread 0.8, the frequency (standardised) the target (2,048 signals, 1,536 to train); a 1-D CNN of two
    convolutions with BatchNorm, mean squared error, plain SGD, batch 16."""
    g = torch.Generator().manual_seed(seed)
    n = 2048
    cycles = 2 + 6 * torch.rand(n, 1, generator=g)
    amplitude = 0.5 + torch.rand(n, 1, generator=g)
    phase = 2 * math.pi * torch.rand(n, 1, generator=g)
    t = torch.arange(64, dtype=torch.float32)
    x = amplitude * torch.sin(2 * math.pi * cycles * t / 64 + phase) + 0.8 * torch.randn(n, 64, generator=g)
    train, val = _split(x.unsqueeze(1), _standardised(cycles), 1536)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(nn.Conv1d(1, 16, 7, padding=3), nn.BatchNorm1d(16), nn.ReLU(), nn.MaxPool1d(2),
                            nn.Conv1d(16, 32, 5, padding=2), nn.BatchNorm1d(32), nn.ReLU(),
                            nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(32, 1))
        return Supervised(net, nn.functional.mse_loss, "sgd", lr)

    return Problem("frequency-regression 1-D CNN + BatchNorm, SGD", make, train, val, batch_size=16)


# ---------------------------------------------------------------------------------------------- tabular
def sparse_uncorrelated_l1(seed: int) -> Problem:
    """sklearn's make_sparse_uncorrelated (10 Gaussian features, 4 of them used, unit noise; target standardised)
    with 5 % of targets replaced by outliers of spread 4 (2,048 samples, 1,536 to train); MLP 10-64-64-1 with
    dropout 0.1, L1 loss, SGD with momentum 0.9 and weight decay 5e-4, batch 32."""
    from sklearn.datasets import make_sparse_uncorrelated

    x, y = make_sparse_uncorrelated(2048, n_features=10, random_state=seed)
    g = torch.Generator().manual_seed(seed)
    target = _standardised(_tensor(y).unsqueeze(1))
    target = torch.where(torch.rand(2048, 1, generator=g) < 0.05, 4 * torch.randn(2048, 1, generator=g), target)
    train, val = _split(_tensor(x), target, 1536)
    optimizer = functools.partial(torch.optim.SGD, momentum=0.9, weight_decay=5e-4)

    def make(lr: float) -> phalanx.Module:
        return OptimizerSupervised(_mlp(10, 64, 64, 1, dropout=0.1), nn.functional.l1_loss, optimizer, lr)

    return Problem("sparse-uncorrelated MLP + dropout (L1 loss), momentum + weight decay", make, train, val)


def multilabel_bow(seed: int) -> Problem:
    """sklearn's make_multilabel_classification as bags of words: counts of 100 words in documents of about 40
    words with 1 to 6 of 6 topics each (log1p of the counts, standardised; 3,072 documents, 2,560 to train); MLP
    100-128-6 with BatchNorm and dropout 0.3, binary cross-entropy per label, Adam, batch 256."""
    from sklearn.datasets import make_multilabel_classification

    x, y = make_multilabel_classification(3072, n_features=100, n_classes=6, n_labels=2, length=40,
                                          random_state=seed)
    train, val = _split(_standardised(_tensor(x).log1p()), _tensor(y), 2560)

    def make(lr: float) -> phalanx.Module:
        net = _mlp(100, 128, 6, norm=nn.BatchNorm1d, dropout=0.3)
        return Supervised(net, _multilabel_cross_entropy, "adam", lr)

    return Problem("multi-label bag-of-words MLP + BatchNorm + dropout, Adam", make, train, val, batch_size=256)


def ordinal_grades(seed: int) -> Problem:
    """5 ordered grades cut at the quintiles of a latent score (a random tanh teacher of 8 Gaussian features plus
    logistic noise; 1,024 samples, 768 to train); MLP 8-64-64-5 with LayerNorm, cross-entropy, Adamax, batch 8."""
    g = torch.Generator().manual_seed(seed)
    n = 1024
    x = torch.randn(n, 8, generator=g)
    u = torch.rand(n, generator=g)
    latent = torch.tanh(x @ torch.randn(8, 16, generator=g) / 2) @ torch.randn(16, generator=g) + (u / (1 - u)).log()
    grade = torch.bucketize(latent, latent.quantile(torch.tensor([0.2, 0.4, 0.6, 0.8])))
    train, val = _split(x, grade, 768)

    def make(lr: float) -> phalanx.Module:
        net = _mlp(8, 64, 64, 5, norm=nn.LayerNorm)
        return OptimizerSupervised(net, nn.functional.cross_entropy, torch.optim.Adamax, lr)

    return Problem("ordinal-grade MLP + LayerNorm, Adamax", make, train, val, batch_size=8)


SIXTH_SET: list[Family] = [gpt2_progressions, bert_marker_count, spot_huber_cnn, symmetry_cnn_bn, trigram_textcnn,
                           ar_coefficient_lstm, distinct_count_transformer, cbow_sgd, frequency_conv1d_bn,
                           sparse_uncorrelated_l1, multilabel_bow, ordinal_grades]
