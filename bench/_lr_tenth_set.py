"""The tenth set of LR-finder problem families, ``TENTH_SET`` (12): written on 2026-11-29, after the ninth set, by
someone who never ran the LR finder on them nor saw any of its results or logs. Only plain fits on the
learning-rate grid (and the initial loss) were run on them while they were written, to check that each trains,
that its best loss stays well above 0, that its best learning rate lies inside the grid and that a fit is cheap;
never the LR finder.

None repeats an earlier family's kind of data, model or loss. Between them: Adam with the gradient norm clipped
inside its step (1), AdamW (1), plain SGD (1), SGD with momentum 0.9 (3), SGD with Nesterov momentum 0.9 (1),
RMSprop (1), Adagrad (1), NAdam (1), RAdam (1) and Adamax (1); a tiny Hugging Face T5 encoder-decoder (relative
position buckets) built from a config, a GRU encoder with a Luong-attention GRU decoder sorting sequences, a GRU
LM under a class-factored (two-level) softmax, DistMult knowledge-graph embeddings against stored negative
samples, a modern Hopfield (softmax attention over learned memories) recalling corrupted patterns, a neural
cellular automaton rolled out over small grids, an MLP-Mixer on image patches, a Set Transformer (self-attention
over set elements, attention pooling by a learned seed), a physics-informed network fitting the heat equation
(finite-difference residual plus sparse noisy data), a zero-inflated Poisson count model, an ArcFace-style
additive angular margin classifier and a von Mises likelihood on angles; three sequence models (the T5, the
attention decoder and the factored-softmax LM); with and without BatchNorm, LayerNorm or dropout; batches of 4 to
512. Data are drawn by a ``torch.Generator`` from the seed; every one has label or target noise (or real
ambiguity), so the best validation loss stays well above 0. Validation sets hold at least 256 samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from _lr_families import Family, _mlp, _split, _standardised, token_cross_entropy
from _lr_fourth_set import AdagradSupervised, NesterovSupervised, _flip
from _lr_held_out import OptimizerSupervised, _grid
from _lr_problems import Problem, Supervised
from _lr_second_set import RMSpropSupervised
from torch import nn
from torch.utils.data import TensorDataset


# ---------------------------------------------------------------------------------------------- sequences
class _T5(nn.Module):
    """A tiny ``transformers`` T5 built from its config (one encoder and one decoder layer, width 32, 4 heads of 8,
    feed-forward 64, 8 relative-position buckets, its default dropout of 0.1). Its input packs the source, then the
    decoder's input (the target shifted right behind the start token 0), along the sequence."""

    def __init__(self, vocab: int, source: int) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        self.source = source
        self.model = T5ForConditionalGeneration(T5Config(
            vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0, eos_token_id=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids=x[:, :self.source], decoder_input_ids=x[:, self.source:]).logits
        return out


def _teacher_forced(source: torch.Tensor, target: torch.Tensor, symbols: int, n_train: int,
                    g: torch.Generator) -> tuple[TensorDataset, TensorDataset]:
    """Pairs for teacher forcing: 10 % of the target tokens replaced by uniform ones (1 to ``symbols``); the input
    packs the source, then the decoder's input (the target shifted right behind the start token 0)."""
    target = torch.where(torch.rand(target.shape, generator=g) < 0.1,
                         torch.randint(1, symbols + 1, target.shape, generator=g), target)
    decoder_input = torch.cat([torch.zeros(len(target), 1, dtype=torch.long), target[:, :-1]], 1)
    return _split(torch.cat([source, decoder_input], 1), target, n_train)


def cipher_t5(seed: int) -> Problem:
    """Sources of 12 tokens from 16 (ids 1 to 16); the target is the source reversed and passed through a
    substitution cipher of the seed's own, 10 % of its tokens then replaced by uniform ones (896 pairs, 640 to
    train); a tiny Hugging Face T5 (``T5ForConditionalGeneration`` from a config) with teacher forcing,
    cross-entropy per target token, AdamW, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, symbols = 896, 12, 16
    source = torch.randint(1, symbols + 1, (n, length), generator=g)
    cipher = torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(symbols, generator=g)])
    train, val = _teacher_forced(source, cipher[source.flip(1)], symbols, 640, g)
    return Problem("cipher-and-reverse Hugging Face T5 encoder-decoder, AdamW",
                   lambda lr: Supervised(_T5(symbols + 1, length), token_cross_entropy, "adamw", lr), train, val)


class _AttentionSeq2Seq(nn.Module):
    """A GRU encoder and a GRU decoder (embedding 24 with dropout 0.1, 48 units each) joined by Luong's "general"
    attention: each decoder state scores the encoder states bilinearly, and the state and its softmax-weighted
    context pass through a tanh layer to the logits. Teacher forcing: the input packs the source, then the
    decoder's input, along the sequence."""

    def __init__(self, vocab: int, source: int, width: int = 48) -> None:
        super().__init__()
        self.source = source
        self.embed, self.dropout = nn.Embedding(vocab, 24), nn.Dropout(0.1)
        self.encoder, self.decoder = nn.GRU(24, width, batch_first=True), nn.GRU(24, width, batch_first=True)
        self.score = nn.Linear(width, width, bias=False)
        self.combine, self.head = nn.Linear(2 * width, width), nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedded = self.dropout(self.embed(x))
        keys, last = self.encoder(embedded[:, :self.source])
        states, _ = self.decoder(embedded[:, self.source:], last)
        weights = (self.score(states) @ keys.transpose(1, 2)).softmax(2)
        out: torch.Tensor = self.head(torch.tanh(self.combine(torch.cat([states, weights @ keys], 2))))
        return out


def sort_attention_gru(seed: int) -> Problem:
    """Sources of 10 tokens from 16 (ids 1 to 16) to be written out in ascending order, 10 % of the target tokens
    replaced by uniform ones (1,280 pairs, 1,024 to train); a GRU encoder-decoder with Luong attention and teacher
    forcing, cross-entropy per target token, Adamax, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, symbols = 1280, 10, 16
    source = torch.randint(1, symbols + 1, (n, length), generator=g)
    train, val = _teacher_forced(source, source.sort(1).values, symbols, 1024, g)
    return Problem("sorting GRU encoder-decoder with Luong attention, Adamax",
                   lambda lr: OptimizerSupervised(_AttentionSeq2Seq(symbols + 1, length), token_cross_entropy,
                                                  torch.optim.Adamax, lr), train, val)


class _FactoredSoftmaxLM(nn.Module):
    """Embedding 32, a GRU of 64 units and a two-level softmax: a head over the word classes and one over all
    words whose softmax is taken within the target's class only. It returns, per position, the class logits and
    the logits of the target class's words (so it needs the targets: the input packs the tokens, then the
    targets, along the sequence)."""

    def __init__(self, classes: int, per_class: int) -> None:
        super().__init__()
        self.per_class = per_class
        self.embed = nn.Embedding(classes * per_class, 32)
        self.rnn = nn.GRU(32, 64, batch_first=True)
        self.class_head, self.word_head = nn.Linear(64, classes), nn.Linear(64, classes * per_class)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, targets = x.chunk(2, 1)
        hidden, _ = self.rnn(self.embed(tokens))
        words = self.word_head(hidden).unflatten(2, (-1, self.per_class))  # (batch, time, class, word in class)
        index = (targets // self.per_class)[..., None, None].expand(-1, -1, 1, self.per_class)
        return torch.cat([self.class_head(hidden), words.gather(2, index).squeeze(2)], 2)


def _factored_nll(logits: torch.Tensor, y: torch.Tensor, classes: int = 16, per_class: int = 15) -> torch.Tensor:
    # -log p(word) = -log p(class) - log p(word | class): the exact negative log-likelihood, nothing sampled.
    return (nn.functional.cross_entropy(logits[..., :classes].flatten(0, 1), (y // per_class).flatten())
            + nn.functional.cross_entropy(logits[..., classes:].flatten(0, 1), (y % per_class).flatten()))


def factored_softmax_lm(seed: int) -> Problem:
    """Sentences of 21 words from 240 in 16 classes of 15: the class follows a random first-order Markov chain
    (each class with 3 likely successors), the word within it a Zipf law (exponent 1.1) over a random order of its
    words (1,280 sentences, 1,024 to train); a GRU LM with a class-factored softmax, the negative log-likelihood
    per word, SGD with momentum 0.9, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, classes, per_class = 1280, 21, 16, 15
    transition = torch.full((classes, classes), 0.2)
    likely = torch.rand(classes, classes, generator=g).argsort(1)[:, :3]
    transition.scatter_(1, likely, 3 + 3 * torch.rand(classes, 3, generator=g))
    zipf = torch.arange(1, per_class + 1, dtype=torch.float32) ** -1.1
    within = torch.stack([zipf[torch.randperm(per_class, generator=g)] for _ in range(classes)])
    word_class = torch.zeros(n, length, dtype=torch.long)
    word_class[:, 0] = torch.randint(0, classes, (n,), generator=g)
    for t in range(1, length):
        word_class[:, t] = torch.multinomial(transition[word_class[:, t - 1]], 1, generator=g).squeeze(1)
    words = word_class * per_class + torch.multinomial(within[word_class.flatten()], 1, generator=g).view(n, length)
    train, val = _split(torch.cat([words[:, :-1], words[:, 1:]], 1), words[:, 1:], 1024)
    return Problem("class-factored softmax GRU LM, momentum",
                   lambda lr: Supervised(_FactoredSoftmaxLM(classes, per_class), _factored_nll, "momentum", lr),
                   train, val)


# ---------------------------------------------------------------------------------------------- memories and graphs
class _DistMult(nn.Module):
    """DistMult knowledge-graph embeddings of 32 (entities and diagonal relations, drawn with spread 0.5 so that
    the first scores are small but their gradients are not): the score of (head, relation, tail) is the sum of
    their elementwise product. Its input row is (head, relation, the true tail, the stored negative tails); it
    returns each tail's score."""

    def __init__(self, entities: int, relations: int, dim: int = 32) -> None:
        super().__init__()
        self.entity, self.relation = nn.Embedding(entities, dim), nn.Embedding(relations, dim)
        for embedding in (self.entity, self.relation):
            nn.init.normal_(embedding.weight, std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query = self.entity(x[:, 0]) * self.relation(x[:, 1])
        scores: torch.Tensor = (query.unsqueeze(1) * self.entity(x[:, 2:])).sum(2)
        return scores


def _negative_sampling_loss(scores: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # The logistic loss of the true tail (column 0) plus the mean logistic loss of the negatives (``y`` marks the
    # true column; it is only there to fit Supervised's shape).
    weights = torch.where(y > 0, 1.0, 1.0 / (scores.shape[1] - 1))
    loss: torch.Tensor = (nn.functional.binary_cross_entropy_with_logits(scores, y, reduction="none") * weights)
    return loss.sum(1).mean()


def kinship_distmult(seed: int) -> Problem:
    """A knowledge graph of 100 entities and 6 relations: each fact's tail drawn from the softmax over all entities
    of 1.5 times a hidden rank-8 DistMult score of the head and relation (3 to 6 plausible tails per query), each
    with 8 negative tails drawn uniformly once and stored (7,680 facts, 7,168 to train); DistMult embeddings, the
    logistic loss against the negatives, Adagrad, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n, entities, relations, negatives = 7680, 100, 6, 8
    true_entity, true_relation = torch.randn(entities, 8, generator=g), torch.randn(relations, 8, generator=g)
    head = torch.randint(0, entities, (n,), generator=g)
    relation = torch.randint(0, relations, (n,), generator=g)
    logits = 1.5 * (true_entity[head] * true_relation[relation]) @ true_entity.T
    tail = torch.multinomial(logits.softmax(1), 1, generator=g)
    x = torch.cat([head[:, None], relation[:, None], tail, torch.randint(0, entities, (n, negatives), generator=g)], 1)
    y = torch.zeros(n, 1 + negatives)
    y[:, 0] = 1
    train, val = _split(x, y, 7168)
    return Problem("DistMult knowledge-graph embeddings (negative sampling), Adagrad",
                   lambda lr: AdagradSupervised(_DistMult(entities, relations), _negative_sampling_loss, lr), train,
                   val, batch_size=64)


class _HopfieldMemory(nn.Module):
    """A modern Hopfield layer (Ramsauer et al.): the projected query attends, with a learned inverse temperature,
    over 32 learned stored patterns, and two such retrieval steps (the second from the first's result) lead to
    per-bit logits read out from the retrieved pattern."""

    def __init__(self, bits: int, memories: int = 32, width: int = 32) -> None:
        super().__init__()
        self.query, self.readout = nn.Linear(bits, width), nn.Linear(width, bits)
        self.keys = nn.Parameter(torch.randn(memories, width))
        self.values = nn.Parameter(torch.randn(memories, width) / math.sqrt(width))
        self.log_beta = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.query(x)
        for _ in range(2):
            state = (self.log_beta.exp() * state @ self.keys.T).softmax(1) @ self.values
        out: torch.Tensor = self.readout(state)
        return out


def hopfield_recall(seed: int) -> Problem:
    """24 hidden patterns of 32 random bits; each sample is one of them with 25 % of its bits flipped, to be
    recalled whole, the target itself with 5 % of its bits flipped (2,304 samples, 1,792 to train); a modern
    Hopfield memory, binary cross-entropy per bit, RMSprop, batch 16."""
    g = torch.Generator().manual_seed(seed)
    n, bits = 2304, 32
    patterns = (torch.rand(24, bits, generator=g) < 0.5).float()
    which = torch.randint(0, 24, (n,), generator=g)
    cue = (patterns[which] + (torch.rand(n, bits, generator=g) < 0.25).float()) % 2
    target = (patterns[which] + (torch.rand(n, bits, generator=g) < 0.05).float()) % 2
    train, val = _split(2 * cue - 1, target, 1792)
    return Problem("corrupted-pattern recall, modern Hopfield memory, RMSprop",
                   lambda lr: RMSpropSupervised(_HopfieldMemory(bits), nn.functional.binary_cross_entropy_with_logits,
                                                lr), train, val, batch_size=16)


# ---------------------------------------------------------------------------------------------- grids and patches
class _ClippedAdam(torch.optim.Adam):
    """Adam that clips the gradients' total norm to 1 inside its own step, so every caller of ``step`` (the fit's
    loop, with or without hooks) sees the same update."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        nn.utils.clip_grad_norm_(grads, 1.0)
        super().step()
        return loss


class _CellularAutomaton(nn.Module):
    """A neural cellular automaton: a state of 8 channels per cell (the first the input), updated 3 times by one
    learned local rule: a 3x3 perception convolution (24 channels), then 1x1 convolutions 24-24-8 (ReLU; the last
    zero so that the rule starts as the identity) added to the state. The second channel is the per-cell logit."""

    def __init__(self, channels: int = 8, steps: int = 3) -> None:
        super().__init__()
        self.channels, self.steps = channels, steps
        self.perceive = nn.Conv2d(channels, 3 * channels, 3, padding=1)
        last = nn.Conv2d(24, channels, 1)
        for parameter in last.parameters():
            nn.init.zeros_(parameter)
        self.update = nn.Sequential(nn.Conv2d(3 * channels, 24, 1), nn.ReLU(), last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = nn.functional.pad(x, (0, 0, 0, 0, 0, self.channels - 1))
        for _ in range(self.steps):
            state = state + self.update(self.perceive(state))
        return state[:, 1:2]


def majority_automaton(seed: int) -> Problem:
    """10x10 grids of cells alive with probability 0.5 (inputs +-1), the target the grid after 2 steps of the
    3x3 majority rule (a cell lives when at least 5 of its 9 cells do; borders dead), 4 % of the target cells
    flipped (1,280 grids, 1,024 to train); a neural cellular automaton of 3 steps, binary cross-entropy per cell,
    Adam with the gradient norm clipped to 1, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n = 1280
    grid = (torch.rand(n, 1, 10, 10, generator=g) < 0.5).float()
    state = grid
    for _ in range(2):
        state = (nn.functional.conv2d(state, torch.ones(1, 1, 3, 3), padding=1) >= 5).float()
    target = (state + (torch.rand(n, 1, 10, 10, generator=g) < 0.04).float()) % 2
    train, val = _split(2 * grid - 1, target, 1024)
    return Problem("majority-rule neural cellular automaton, Adam with gradient clipping",
                   lambda lr: OptimizerSupervised(_CellularAutomaton(), nn.functional.binary_cross_entropy_with_logits,
                                                  _ClippedAdam, lr), train, val)


class _MixerBlock(nn.Module):
    """An MLP-Mixer block: LayerNorm and a token-mixing MLP across the patches, then LayerNorm and a channel MLP,
    each residual."""

    def __init__(self, tokens: int, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.tokens = _mlp(tokens, 2 * tokens, tokens, act=nn.GELU)
        self.channels = _mlp(width, 2 * width, width, act=nn.GELU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        out: torch.Tensor = x + self.channels(self.norm2(x))
        return out


class _Mixer(nn.Module):
    """An MLP-Mixer on 16x16 images: 4x4 patches embedded to 32, two mixer blocks, LayerNorm, mean over the patches
    and a linear head (4 classes)."""

    def __init__(self, patch: int = 4, width: int = 32) -> None:
        super().__init__()
        tokens = (16 // patch) ** 2
        self.embed = nn.Conv2d(1, width, patch, stride=patch)
        self.blocks = nn.Sequential(_MixerBlock(tokens, width), _MixerBlock(tokens, width), nn.LayerNorm(width))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.embed(x).flatten(2).transpose(1, 2)).mean(1))
        return out


def square_count_mixer(seed: int) -> Problem:
    """16x16 images of 1 to 4 bright 3x3 squares (the class) at random places (possibly touching or overlapping),
    of brightness 0.6 to 1.4, under pixel noise of spread 0.6, 5 % of labels redrawn (2,560 images, 2,048 to train);
    an MLP-Mixer with LayerNorm, cross-entropy, SGD with Nesterov momentum 0.9, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 2560
    rows, cols = _grid(16)
    count = torch.randint(1, 5, (n,), generator=g)
    image = torch.zeros(n, 16, 16)
    for k in range(4):
        corner = torch.randint(0, 14, (n, 2, 1, 1), generator=g)
        square = ((rows >= corner[:, 0]) & (rows < corner[:, 0] + 3) & (cols >= corner[:, 1])
                  & (cols < corner[:, 1] + 3) & (count > k).view(n, 1, 1))
        image = torch.maximum(image, square * (0.6 + 0.8 * torch.rand(n, 1, 1, generator=g)))
    image = image + 0.6 * torch.randn(n, 16, 16, generator=g)
    train, val = _split(image.unsqueeze(1), _flip(count - 1, 4, 0.05, g), 2048)
    return Problem("square-counting MLP-Mixer + LayerNorm, Nesterov",
                   lambda lr: NesterovSupervised(_Mixer(), nn.functional.cross_entropy, lr), train, val, batch_size=64)


# ---------------------------------------------------------------------------------------------- sets and fields
class _SetTransformer(nn.Module):
    """A Set Transformer (Lee et al.): points embedded to 32, one self-attention block over the set's elements
    (4 heads, pre-LayerNorm, feed-forward 64), then pooling by multi-head attention from one learned seed, LayerNorm
    and a linear head. Equivariant until the pooling, invariant after it."""

    def __init__(self, features: int, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.block = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.seed = nn.Parameter(torch.randn(1, 1, width) / math.sqrt(width))
        self.pool = nn.MultiheadAttention(width, 4, batch_first=True)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(x))
        pooled, _ = self.pool(self.seed.expand(len(x), -1, -1), h, h, need_weights=False)
        out: torch.Tensor = self.head(self.norm(pooled.squeeze(1)))
        return out


def close_pairs_set(seed: int) -> Problem:
    """Sets of 16 points in 2-D, uniform in a square of side 2 to 4 of the set's own; the target is the number of
    points with another within distance 0.5 (an interaction no sum of per-point terms gives), standardised, plus
    noise of spread 0.3 (2,048 sets, 1,536 to train); a Set Transformer, mean squared error, RAdam, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, size = 2048, 16
    points = (torch.rand(n, size, 2, generator=g) - 0.5) * (2 + 2 * torch.rand(n, 1, 1, generator=g))
    distance = torch.cdist(points, points) + 1e9 * torch.eye(size)
    close = (distance.min(2).values < 0.5).float().sum(1, keepdim=True)
    y = _standardised(close) + 0.3 * torch.randn(n, 1, generator=g)
    train, val = _split(points, y, 1536)
    return Problem("close-pairs Set Transformer (attention pooling) + LayerNorm, RAdam",
                   lambda lr: OptimizerSupervised(_SetTransformer(2), nn.functional.mse_loss, torch.optim.RAdam, lr),
                   train, val)


class _HeatField(nn.Module):
    """A tanh MLP 2-64-64-1 for u(x, t). Besides u at each row's point it returns the heat equation's residual
    u_t - kappa u_xx there, by central differences of step 0.02 (no autograd through the inputs, so that
    validation under inference mode computes the same loss)."""

    scale: torch.Tensor

    def __init__(self, kappa: float, step: float = 0.02) -> None:
        super().__init__()
        self.kappa, self.step = kappa, step
        self.u = _mlp(2, 64, 64, 1, act=nn.Tanh)
        # x in [0, 1] and t in [0, 0.5] mapped onto [-1, 1], where the tanh units start out useful
        self.register_buffer("scale", torch.tensor([2.0, 4.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.step
        shifts = torch.tensor([[0.0, 0.0], [h, 0.0], [-h, 0.0], [0.0, h], [0.0, -h]])
        u = self.u((x[:, None, :2] + shifts) * self.scale - 1).squeeze(2)  # (rows, 5): centre, x+h, x-h, t+h, t-h
        u_t = (u[:, 3] - u[:, 4]) / (2 * h)
        u_xx = (u[:, 1] - 2 * u[:, 0] + u[:, 2]) / h**2
        return torch.stack([u[:, 0], u_t - self.kappa * u_xx], 1)


def _physics_informed_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Squared error at the observed rows (y[:, 1] = 1) plus the squared residual, weighted by 0.01, at the
    # collocation rows; both averaged over all rows of the batch.
    observed = y[:, 1]
    return (observed * (out[:, 0] - y[:, 0]) ** 2 + 0.01 * (1 - observed) * out[:, 1] ** 2).mean()


def heat_pinn(seed: int) -> Problem:
    """The heat equation u_t = 0.1 u_xx on x in [0, 1], t in [0, 0.5], u = 0 at both ends, from a start of three
    sine modes of the seed's own amplitudes (their root sum of squares 1.5); rows are observations of u at
    random points under noise of spread 0.3 (half of them) or collocation points where only the residual counts
    (2,560 rows, 2,048 to train); a physics-informed tanh MLP (finite-difference residual plus data), SGD with
    momentum 0.9, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n, kappa = 2560, 0.1
    amplitude = torch.randn(3, generator=g)
    amplitude = 1.5 * amplitude / amplitude.norm()  # the same overall size for every seed
    points = torch.rand(n, 2, generator=g) * torch.tensor([1.0, 0.5])
    modes = torch.arange(1, 4, dtype=torch.float32) * math.pi
    u = (amplitude * torch.exp(-kappa * modes**2 * points[:, 1:]) * torch.sin(modes * points[:, :1])).sum(1)
    observed = (torch.rand(n, generator=g) < 0.5).float()
    y = torch.stack([(u + 0.3 * torch.randn(n, generator=g)) * observed, observed], 1)
    train, val = _split(points, y, 2048)
    return Problem("heat-equation physics-informed MLP (finite-difference residual + data), momentum",
                   lambda lr: Supervised(_HeatField(kappa), _physics_informed_loss, "momentum", lr), train, val,
                   batch_size=64)


# ---------------------------------------------------------------------------------------------- likelihoods and margins
def _zero_inflated_poisson_nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # out: the logit of a structural zero and the log-rate. A zero is either structural or a Poisson zero; a
    # positive count only a Poisson draw. Positive: the probability of a count is at most 1.
    logit, log_rate = out[:, 0], out[:, 1]
    y = y.squeeze(1)
    log_pi, log_not_pi = nn.functional.logsigmoid(logit), nn.functional.logsigmoid(-logit)
    poisson = y * log_rate - log_rate.exp() - torch.lgamma(y + 1)
    zero = torch.logaddexp(log_pi, log_not_pi - log_rate.exp())
    return -torch.where(y == 0, zero, log_not_pi + poisson).mean()


def zero_inflated_counts(seed: int) -> Problem:
    """Counts from 6 Gaussian features: a structural zero with probability sigmoid(teacher A), otherwise a Poisson
    draw of log-rate 1 + teacher B (random tanh teachers; about 40 % zeros; 896 samples, 384 to train); MLP 6-32-2
    giving the zero logit and the log-rate, zero-inflated Poisson negative log-likelihood, plain SGD, batch 4."""
    g = torch.Generator().manual_seed(seed)
    n = 896
    x = torch.randn(n, 6, generator=g)
    hidden = torch.tanh(x @ torch.randn(6, 16, generator=g) / 2)
    logit_zero = hidden @ torch.randn(16, generator=g) / 2 - 0.3
    log_rate = 1 + 0.6 * _standardised(hidden @ torch.randn(16, generator=g))
    counts = torch.poisson(log_rate.exp(), generator=g) * (torch.rand(n, generator=g) >= logit_zero.sigmoid())
    train, val = _split(x, counts.unsqueeze(1), 384)
    return Problem("zero-inflated Poisson counts MLP, SGD",
                   lambda lr: Supervised(_mlp(6, 32, 2), _zero_inflated_poisson_nll, "sgd", lr), train, val,
                   batch_size=4)


class _ArcFace(nn.Module):
    """An MLP embedding (features-128-64 with BatchNorm) scaled to unit length, and unit-length class weights:
    it returns the cosines of the angles between them (the additive angular margin is the loss's)."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.embed = _mlp(features, 128, 64, norm=nn.BatchNorm1d)
        self.weight = nn.Parameter(torch.randn(classes, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.embed(x), dim=1) @ nn.functional.normalize(self.weight, dim=1).T


def _arcface_loss(cosine: torch.Tensor, y: torch.Tensor, scale: float = 16.0, margin: float = 0.3) -> torch.Tensor:
    # Cross-entropy on scale x cos(angle + margin) for the true class and scale x cos(angle) for the others (Deng et
    # al.); the cosine is kept off +-1, where acos's gradient is infinite.
    angle = torch.acos(cosine.clamp(-1 + 1e-6, 1 - 1e-6))
    true = nn.functional.one_hot(y, cosine.shape[1]).bool()
    return nn.functional.cross_entropy(scale * torch.where(true, torch.cos(angle + margin), cosine), y)


def arcface_identities(seed: int) -> Problem:
    """64 identities: centres in a 16-D latent (spread 1), samples around them of spread 0.7, seen through a fixed
    random tanh layer of 32 features (11,264 samples, 10,240 to train); an MLP embedding with BatchNorm under an
    ArcFace additive angular margin (0.3, scale 16), SGD with momentum 0.9, batch 512."""
    g = torch.Generator().manual_seed(seed)
    n, identities = 11264, 64
    identity = torch.randint(0, identities, (n,), generator=g)
    latent = torch.randn(identities, 16, generator=g)[identity] + 0.7 * torch.randn(n, 16, generator=g)
    x = _standardised(torch.tanh(latent @ torch.randn(16, 32, generator=g) / 2))
    train, val = _split(x, identity, 10240)
    return Problem("ArcFace angular-margin embedding + BatchNorm, momentum",
                   lambda lr: Supervised(_ArcFace(32, identities), _arcface_loss, "momentum", lr), train, val,
                   batch_size=512)


def _von_mises_nll(out: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    # out: an unnormalised direction (2) and the log-concentration. -kappa cos(angle - mu) + log(2 pi I0(kappa)),
    # with log I0 from the scaled Bessel function for stability. Positive on these data: the noise is wide enough
    # (concentration at most 6) that no density on the circle exceeds 1 by much.
    direction = nn.functional.normalize(out[:, :2], dim=1)
    kappa = out[:, 2].clamp(max=5).exp()
    cosine = direction[:, 0] * angle.cos().squeeze(1) + direction[:, 1] * angle.sin().squeeze(1)
    log_i0: torch.Tensor = torch.special.i0e(kappa).log() + kappa
    return (-kappa * cosine + math.log(2 * math.pi) + log_i0).mean()


def wind_direction_vonmises(seed: int) -> Problem:
    """Angles from 5 Gaussian features: the direction of a random tanh teacher's 2-D output, von Mises noise of
    concentration 1.5 to 6 set by another feature combination (2,560 samples, 2,048 to train); MLP 5-64-64-3 with
    LayerNorm giving a direction and a log-concentration, von Mises negative log-likelihood, NAdam, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 2560
    x = torch.randn(n, 5, generator=g)
    teacher = torch.tanh(x @ torch.randn(5, 16, generator=g) / 2) @ torch.randn(16, 2, generator=g)
    kappa = 1.5 + 4.5 * torch.sigmoid(x @ torch.randn(5, generator=g))
    with torch.random.fork_rng(devices=[]):  # VonMises samples from the global generator: seeded here, restored after
        torch.manual_seed(seed)
        noise = torch.distributions.VonMises(torch.zeros(n), kappa).sample()
    angle = torch.atan2(teacher[:, 1], teacher[:, 0]) + noise
    train, val = _split(x, torch.remainder(angle, 2 * math.pi).unsqueeze(1), 2048)
    return Problem("von Mises angle regression MLP + LayerNorm, NAdam",
                   lambda lr: OptimizerSupervised(_mlp(5, 64, 64, 3, norm=nn.LayerNorm), _von_mises_nll,
                                                  torch.optim.NAdam, lr), train, val, batch_size=64)


TENTH_SET: list[Family] = [cipher_t5, sort_attention_gru, factored_softmax_lm, kinship_distmult, hopfield_recall,
                           majority_automaton, square_count_mixer, close_pairs_set, heat_pinn, zero_inflated_counts,
                           arcface_identities, wind_direction_vonmises]
