"""The twelfth set of LR-finder problem families, ``TWELFTH_SET`` (12): written after the eleventh set, blind, by
someone who never ran the LR finder on them nor saw any of its results or logs. Only plain fits on the
learning-rate grid (and the initial loss) were run on them while they were written, to check that each trains,
that its best loss stays well above 0, that its best learning rate lies inside the grid and that a fit is cheap;
never the LR finder.

None repeats an earlier family's kind of data, model or loss. Between them: Adam (1), Adam with L2 weight decay
(1), Adam with AMSGrad (1), AdamW with weight decay 0.1 (1), plain SGD (1), SGD with momentum 0.9 and weight
decay (1), SGD with Nesterov momentum 0.9 (1), averaged SGD (ASGD, 1), RMSprop (1), NAdam (1), RAdam (1) and
Adamax (1); a tiny Hugging Face GPT-NeoX (parallel residual, partial rotary positions) as a causal LM, a tiny
Hugging Face ALBERT (factorised embeddings, one layer's weights shared by all) comparing token counts, a neural
collaborative filter (NeuMF) under the BPR loss on implicit feedback, a denoising score-matching model, a
conditional flow-matching velocity model, a sparse top-2 mixture of experts with a load-balancing auxiliary loss,
a two-level hierarchical softmax, a CNN tagging BIO spans, an autoregressive MLP under a Student-t likelihood, a
small ResNet trained under flip-and-shift augmentation, an Elman RNN recalling a cue across a delay (slow to
start) and a pointer network with Bahdanau (additive) attention ordering numbers; five sequence models (the
GPT-NeoX, the ALBERT, the CNN tagger, the Elman RNN and the pointer network); with and without BatchNorm,
LayerNorm or dropout; batches of 4 to 512. Data are drawn by a ``torch.Generator`` from the seed; every one has
label or target noise (or real ambiguity), so the best validation loss stays well above 0. Validation sets hold at
least 256 samples.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from _lr_families import Family, _mlp, _split, _standardised, token_cross_entropy
from _lr_fourth_set import NesterovSupervised, _flip
from _lr_held_out import OptimizerSupervised, _grid
from _lr_problems import Problem, Supervised
from _lr_second_set import RMSpropSupervised
from torch import nn


# ---------------------------------------------------------------------------------------------- Hugging Face
class _NeoX(nn.Module):
    """A tiny ``transformers`` GPT-NeoX built from its config (2 layers, width 32, 4 heads, feed-forward 64, rotary
    positions on half of each head), returning the next-token logits."""

    def __init__(self, vocab: int, context: int) -> None:
        super().__init__()
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        self.model = GPTNeoXForCausalLM(GPTNeoXConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=context, bos_token_id=0, eos_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            initializer_range=0.05))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids=x).logits
        return out


def motif_neox(seed: int) -> Problem:
    """Sequences of 19 tokens from 12: a random 3-token motif repeated, 15 % of tokens then replaced by uniform
    ones (960 sequences, 704 to train); a tiny Hugging Face GPT-NeoX as a next-token LM, AdamW with weight
    decay 0.1, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab = 960, 19, 12
    seqs = torch.randint(0, vocab, (n, 3), generator=g).repeat(1, 7)[:, :length]
    seqs = torch.where(torch.rand(n, length, generator=g) < 0.15, torch.randint(0, vocab, (n, length), generator=g),
                       seqs)
    train, val = _split(seqs[:, :-1], seqs[:, 1:], 704)
    return Problem("repeated-motif Hugging Face GPT-NeoX LM, AdamW (weight decay 0.1)",
                   lambda lr: OptimizerSupervised(_NeoX(vocab, length - 1), token_cross_entropy,
                                                  functools.partial(torch.optim.AdamW, weight_decay=0.1), lr),
                   train, val)


class _Albert(nn.Module):
    """A tiny ``transformers`` ALBERT classifier built from its config (embeddings of 16 factored up to width 32,
    2 layers sharing one set of weights, 4 heads, feed-forward 64), returning the class logits."""

    def __init__(self, vocab: int, context: int, classes: int) -> None:
        super().__init__()
        from transformers import AlbertConfig, AlbertForSequenceClassification

        config = AlbertConfig(vocab_size=vocab, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=64, max_position_embeddings=context,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                              classifier_dropout_prob=0.0, initializer_range=0.1)
        config.num_labels = classes
        self.model = AlbertForSequenceClassification(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids=x).logits
        return out


def count_comparison_albert(seed: int) -> Problem:
    """A class token then 10 tokens: each place holds marker A (probability 0.2), marker B (0.2) or one of 8 filler
    tokens; the label says whether A outnumbers B (a fair coin on ties), 5 % of labels redrawn (1,152 sequences,
    896 to train); a tiny Hugging Face ALBERT (``AlbertForSequenceClassification`` from a config),
    cross-entropy, Adam with AMSGrad, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length = 1152, 10
    u = torch.rand(n, length, generator=g)
    x = torch.where(u < 0.2, 1, torch.where(u < 0.4, 2, torch.randint(3, 11, (n, length), generator=g)))
    difference = (x == 1).sum(1) - (x == 2).sum(1)
    coin = torch.randint(0, 2, (n,), generator=g)
    label = torch.where(difference == 0, coin, (difference > 0).long())
    x = torch.cat([torch.zeros(n, 1, dtype=torch.long), x], 1)
    train, val = _split(x, _flip(label, 2, 0.05, g), 896)
    return Problem("A-versus-B count-comparison Hugging Face ALBERT classifier, Adam (AMSGrad)",
                   lambda lr: OptimizerSupervised(_Albert(11, length + 1, 2), nn.functional.cross_entropy,
                                                  functools.partial(torch.optim.Adam, amsgrad=True), lr),
                   train, val)


# ---------------------------------------------------------------------------------------------- recommendation
class _NeuMF(nn.Module):
    """Neural collaborative filtering: a generalised matrix factorisation (the product of user and item embeddings of
    8, weighted) plus an MLP on another pair of embeddings of 8 (16-32-1); the input is (user, positive item,
    negative item) and the output the difference of the two items' scores."""

    def __init__(self, users: int, items: int) -> None:
        super().__init__()
        self.user_gmf, self.item_gmf = nn.Embedding(users, 8), nn.Embedding(items, 8)
        self.user_mlp, self.item_mlp = nn.Embedding(users, 8), nn.Embedding(items, 8)
        for embedding in (self.user_gmf, self.item_gmf, self.user_mlp, self.item_mlp):
            nn.init.normal_(embedding.weight, std=0.1)
        self.gmf = nn.Linear(8, 1, bias=False)
        self.mlp = _mlp(16, 32, 1)

    def score(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        gmf: torch.Tensor = self.gmf(self.user_gmf(user) * self.item_gmf(item))
        mlp: torch.Tensor = self.mlp(torch.cat([self.user_mlp(user), self.item_mlp(item)], 1))
        return (gmf + mlp).squeeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(x[:, 0], x[:, 1]) - self.score(x[:, 0], x[:, 2])


def _bpr_loss(difference: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Bayesian personalised ranking: -log sigmoid(score of the consumed item - score of the sampled one).
    return -nn.functional.logsigmoid(difference).mean()


def implicit_feedback_bpr(seed: int) -> Problem:
    """64 users and 96 items with rank-4 teacher factors; each triple holds a user, an item drawn from the softmax
    of that user's teacher scores (a consumption) and a uniformly drawn item, which may be as good (11,264
    triples, 10,240 to train); a NeuMF collaborative filter, BPR loss, Adam, batch 512."""
    g = torch.Generator().manual_seed(seed)
    n, users, items = 11264, 64, 96
    scores = torch.randn(users, 4, generator=g) @ torch.randn(4, items, generator=g)
    user = torch.randint(0, users, (n,), generator=g)
    positive = torch.multinomial(scores[user].softmax(1), 1, generator=g).squeeze(1)
    negative = torch.randint(0, items, (n,), generator=g)
    train, val = _split(torch.stack([user, positive, negative], 1), torch.zeros(n), 10240)
    return Problem("implicit-feedback NeuMF collaborative filter (BPR loss), Adam",
                   lambda lr: Supervised(_NeuMF(users, items), _bpr_loss, "adam", lr), train, val, batch_size=512)


# ---------------------------------------------------------------------------------------------- generative regression
def _weighted_score_matching(score: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # y: the noise eps and log sigma. sigma^2 ||s(x + sigma eps) + eps / sigma||^2 = ||sigma s + eps||^2.
    sigma = y[:, 2:].exp()
    return ((sigma * score + y[:, :2]) ** 2).sum(1).mean()


def spiral_score_matching(seed: int) -> Problem:
    """Points of a 2-D spiral (radius growing with the angle, turned by the seed's own angle, spread 0.1) under
    Gaussian noise of a level sigma log-uniform on [0.1, 1.5]; the input is the noisy point and log sigma, the
    target the noise (4,352 samples, 4,096 to train); a SiLU MLP 3-128-128-2 giving the score, sigma^2-weighted
    denoising score matching, RAdam, batch 128."""
    g = torch.Generator().manual_seed(seed)
    n = 4352
    t = 3 * math.pi * torch.rand(n, generator=g) + 2 * math.pi * torch.rand(1, generator=g)
    radius = 0.5 + 0.25 * (t - t.min())
    clean = radius[:, None] * torch.stack([t.cos(), t.sin()], 1) + 0.1 * torch.randn(n, 2, generator=g)
    log_sigma = math.log(0.2) + math.log(15) * torch.rand(n, 1, generator=g)
    noise = torch.randn(n, 2, generator=g)
    x = torch.cat([clean + log_sigma.exp() * noise, log_sigma], 1)
    train, val = _split(x, torch.cat([noise, log_sigma], 1), 4096)
    return Problem("spiral denoising score model (sigma-weighted score matching), RAdam",
                   lambda lr: OptimizerSupervised(_mlp(3, 128, 128, 2, act=nn.SiLU), _weighted_score_matching,
                                                  torch.optim.RAdam, lr), train, val, batch_size=64)


def conditional_flow_matching(seed: int) -> Problem:
    """For a class c of 4, targets x1 on a ring of radius 1 + c/2 (spread 0.15); a source point x0 ~ N(0, I) and a
    time t ~ U(0, 1) give x_t = (1 - t) x0 + t x1; the input is x_t, t and c one-hot, the target the velocity x1 -
    x0 (3,328 samples, 3,072 to train); MLP 7-128-128-2 with LayerNorm (SiLU), flow-matching mean squared error,
    NAdam, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 3328
    c = torch.randint(0, 4, (n,), generator=g)
    angle = 2 * math.pi * torch.rand(n, generator=g)
    x1 = (1 + c[:, None] / 2) * torch.stack([angle.cos(), angle.sin()], 1) + 0.15 * torch.randn(n, 2, generator=g)
    x0, t = torch.randn(n, 2, generator=g), torch.rand(n, 1, generator=g)
    x = torch.cat([(1 - t) * x0 + t * x1, t, nn.functional.one_hot(c, 4).float()], 1)
    train, val = _split(x, x1 - x0, 3072)
    return Problem("class-conditional ring flow-matching velocity MLP + LayerNorm, NAdam",
                   lambda lr: OptimizerSupervised(_mlp(7, 128, 128, 2, act=nn.SiLU, norm=nn.LayerNorm),
                                                  nn.functional.mse_loss, torch.optim.NAdam, lr), train, val,
                   batch_size=64)


# ---------------------------------------------------------------------------------------------- classification
class _TopTwoExperts(nn.Module):
    """A linear router over ``experts`` MLPs (features-32-classes), each input sent to its top 2 experts (their router
    probabilities renormalised); ``aux`` keeps the Switch load-balancing loss of the last call (1 when balanced)."""

    def __init__(self, features: int, classes: int, experts: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(features, experts)
        self.experts = nn.ModuleList([_mlp(features, 32, classes) for _ in range(experts)])
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(1)
        top, chosen = probs.topk(2, 1)
        weights = torch.zeros_like(probs).scatter(1, chosen, top / top.sum(1, keepdim=True))
        outputs = torch.stack([expert(x) for expert in self.experts], 1)  # (row, expert, class)
        share = torch.zeros_like(probs).scatter(1, chosen[:, :1], 1.0).mean(0)
        self.aux = len(self.experts) * (share * probs.mean(0)).sum()
        return (weights.unsqueeze(2) * outputs).sum(1)


class _AuxLossSupervised(NesterovSupervised):
    """:class:`NesterovSupervised` adding 0.05 times the network's auxiliary loss to the task loss."""

    def step_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        task = self.loss(self.net(x), y)
        aux = self.net.aux
        assert isinstance(aux, torch.Tensor)
        return task + 0.05 * aux


def regime_top2_experts(seed: int) -> Problem:
    """16 Gaussian features; the signs of the first two pick one of 4 random linear teachers whose argmax over 5
    classes is the label, 10 % of labels redrawn (2,560 samples, 2,304 to train); a sparse top-2 mixture of
    8 experts, cross-entropy plus a load-balancing loss, SGD with Nesterov momentum 0.9, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 2560
    x = torch.randn(n, 16, generator=g)
    regime = (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
    logits = torch.einsum("nf,nfc->nc", x, torch.randn(4, 16, 5, generator=g)[regime])
    train, val = _split(x, _flip(logits.argmax(1), 5, 0.1, g), 2304)
    return Problem("regime sparse top-2 mixture of experts (load-balancing loss), Nesterov",
                   lambda lr: _AuxLossSupervised(_TopTwoExperts(16, 5), nn.functional.cross_entropy, lr), train, val)


def _hierarchical_softmax(out: torch.Tensor, y: torch.Tensor, groups: int = 4) -> torch.Tensor:
    # out: ``groups`` group logits, then groups x per logits of the classes within each group; -log p(group) -
    # log p(class | group), the class y being group * per + index.
    per = (out.shape[1] - groups) // groups
    within = out[:, groups:].unflatten(1, (groups, per))[torch.arange(len(y)), y // per]
    return nn.functional.cross_entropy(out[:, :groups], y // per) + nn.functional.cross_entropy(within, y % per)


def hierarchical_softmax(seed: int) -> Problem:
    """16 classes in 4 groups of 4: a group from a random linear teacher of 10 Gaussian features, a class within it
    from a second teacher of the same features, 10 % of labels redrawn (1,024 samples, 480 to train, 544 to
    validate); MLP 10-64-20 (4 group logits, 16 within-group ones), two-level hierarchical softmax, plain SGD,
    batch 4."""
    g = torch.Generator().manual_seed(seed)
    n = 1024
    x = torch.randn(n, 10, generator=g)
    group = (x @ torch.randn(10, 4, generator=g)).argmax(1)
    within = (torch.tanh(x @ torch.randn(10, 16, generator=g)) @ torch.randn(16, 4, generator=g)).argmax(1)
    train, val = _split(x, _flip(4 * group + within, 16, 0.1, g), 480)
    return Problem("two-level hierarchical-softmax MLP, SGD",
                   lambda lr: Supervised(_mlp(10, 64, 20), _hierarchical_softmax, "sgd", lr), train, val,
                   batch_size=4)


class _SpanTaggerCNN(nn.Module):
    """Embedding 16, two width-5 convolutions of 48 filters (ReLU, dropout 0.2), a per-position linear head."""

    def __init__(self, vocab: int, tags: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.convs = nn.Sequential(nn.Conv1d(16, 48, 5, padding=2), nn.ReLU(), nn.Dropout(0.2),
                                   nn.Conv1d(48, 48, 5, padding=2), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Conv1d(48, tags, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.convs(self.embed(x).transpose(1, 2))).transpose(1, 2)
        return out


def bio_span_cnn(seed: int) -> Problem:
    """Sequences of 24 tokens: filler tokens from 12, with 2 spans of 1 to 4 entity tokens (from 6) starting at
    random places (a span that runs into another merges with it), 8 % of filler places then given an entity token
    tagged O; the tags are O, B (a span's first token) and I (1,536 sequences, 1,024 to train); a CNN tagger,
    cross-entropy per position, Adamax, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length = 1536, 24
    x = torch.randint(7, 19, (n, length), generator=g)
    tags = torch.zeros(n, length, dtype=torch.long)
    for _ in range(2):
        start = torch.randint(0, length - 4, (n,), generator=g)
        size = torch.randint(1, 5, (n,), generator=g)
        for k in range(4):
            rows = torch.nonzero(k < size).squeeze(1)
            place = start[rows] + k
            tags[rows, place] = torch.where(tags[rows, place] == 0, 1 if k == 0 else 2, tags[rows, place])
            x[rows, place] = torch.randint(1, 7, (len(rows),), generator=g)
    decoy = (torch.rand(n, length, generator=g) < 0.2) & (tags == 0)
    x = torch.where(decoy, torch.randint(1, 7, (n, length), generator=g), x)
    train, val = _split(x, _flip(tags.flatten(), 3, 0.05, g).view(n, length), 1024)
    return Problem("BIO span-tagging CNN + dropout, Adamax",
                   lambda lr: OptimizerSupervised(_SpanTaggerCNN(19, 3), token_cross_entropy, torch.optim.Adamax,
                                                  lr), train, val)


# ---------------------------------------------------------------------------------------------- series
def _student_t_nll(out: torch.Tensor, y: torch.Tensor, df: float = 4.0) -> torch.Tensor:
    # out: mean and a raw scale; the negative log-density of y under a Student-t of ``df`` degrees of freedom.
    scale = nn.functional.softplus(out[:, 1]) + 1e-3
    z = (y.squeeze(1) - out[:, 0]) / scale
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return (-log_norm + scale.log() + (df + 1) / 2 * torch.log1p(z**2 / df)).mean()


def student_t_autoregression(seed: int) -> Problem:
    """Windows of 12 past values of nonlinear AR(3) series (x_t = 0.5 x_{t-1} - 0.3 x_{t-2} + tanh(x_{t-3}) plus
    Student-t noise of 3 degrees of freedom), the next value to predict (1,792 windows from independent series,
    1,536 to train); MLP 12-64-64-2 giving a mean and scale, Student-t negative log-likelihood, averaged SGD
    (ASGD), batch 16."""
    g = torch.Generator().manual_seed(seed)
    n, steps = 1792, 40
    series = torch.zeros(n, steps)
    for t in range(3, steps):
        noise = torch.randn(n, generator=g) / (torch.randn(n, 3, generator=g) ** 2).mean(1).sqrt()
        series[:, t] = 0.5 * series[:, t - 1] - 0.3 * series[:, t - 2] + torch.tanh(series[:, t - 3]) + 0.5 * noise
    series = _standardised(series[:, -13:])
    train, val = _split(series[:, :12], series[:, 12:], 1536)
    return Problem("nonlinear AR Student-t likelihood MLP, ASGD",
                   lambda lr: OptimizerSupervised(_mlp(12, 64, 64, 2), _student_t_nll, torch.optim.ASGD, lr),
                   train, val, batch_size=16)


class _ElmanRecall(nn.Module):
    """A tanh Elman RNN of 32 units (``nn.RNN``), a linear head on its last hidden state."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.rnn, self.head = nn.RNN(features, 32, batch_first=True), nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.rnn(x)[0][:, -1])
        return out


def delayed_recall_elman(seed: int) -> Problem:
    """Sequences of 14 steps of 4 channels of noise (spread 0.5); at the first step one of 3 cue channels gets +1.5,
    and that channel is the class, 10 % of labels redrawn (1,536 sequences, 1,280 to train); an Elman RNN
    that must carry the cue across 13 steps of distractors (slow to start), cross-entropy, RMSprop, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, steps = 1536, 14
    label = torch.randint(0, 3, (n,), generator=g)
    x = 0.5 * torch.randn(n, steps, 4, generator=g)
    x[torch.arange(n), 0, label] += 1.5
    train, val = _split(x, _flip(label, 3, 0.1, g), 1280)
    return Problem("delayed-cue recall Elman RNN, RMSprop",
                   lambda lr: RMSpropSupervised(_ElmanRecall(4, 3), nn.functional.cross_entropy, lr), train, val)


class _PointerNetwork(nn.Module):
    """Each number embedded (1-32), a GRU encoder of 32; a GRUCell decoder fed the encoding of the element pointed
    at before (teacher forcing from the targets; a learned start vector first) whose state scores every position by
    Bahdanau's additive attention v . tanh(W e + U d); the logits over positions, per decoding step."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(1, width)
        self.encoder = nn.GRU(width, width, batch_first=True)
        self.decoder = nn.GRUCell(width, width)
        self.start = nn.Parameter(torch.zeros(width))
        self.keys, self.query = nn.Linear(width, width, bias=False), nn.Linear(width, width)
        self.v = nn.Linear(width, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, order = x[:, :, :1], x[:, :, 1].long()
        encoded, last = self.encoder(self.embed(values))
        keys, state = self.keys(encoded), last[0]
        step_input = self.start.expand(len(x), -1)
        logits = []
        for t in range(x.shape[1]):
            state = self.decoder(step_input, state)
            logits.append(self.v(torch.tanh(keys + self.query(state).unsqueeze(1))).squeeze(2))
            step_input = encoded[torch.arange(len(x)), order[:, t]]
        return torch.stack(logits, 1)


def sorting_pointer_network(seed: int) -> Problem:
    """Sets of 6 numbers uniform on [0, 1] seen under noise of spread 0.05; the targets are their positions in the
    order of the true values (ties in sight make the order ambiguous); the input carries the targets too, for
    teacher forcing (1,536 sets, 1,280 to train); a pointer network with Bahdanau attention, cross-entropy per
    step, Adam with L2 weight decay 1e-4, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, size = 1536, 6
    true = torch.rand(n, size, generator=g)
    order = true.argsort(1)
    seen = true + 0.05 * torch.randn(n, size, generator=g)
    x = torch.stack([(seen - 0.5) * 3, order.float()], 2)
    train, val = _split(x, order, 1024)
    return Problem("noisy-sort pointer network (Bahdanau attention), Adam + L2 weight decay",
                   lambda lr: OptimizerSupervised(_PointerNetwork(), token_cross_entropy,
                                                  functools.partial(torch.optim.Adam, weight_decay=1e-4), lr),
                   train, val)


# ---------------------------------------------------------------------------------------------- images
class _ResNet(nn.Module):
    """Conv 3x3 to 12 with BatchNorm, a residual block (two 3x3 convs with BatchNorm), a strided block to 24 with a
    1x1 shortcut, global average pooling and a linear head."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                    nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.block2 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                    nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.shortcut = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2), nn.BatchNorm2d(16))
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = torch.relu(h + self.block1(h))
        h = torch.relu(self.shortcut(h) + self.block2(h))
        out: torch.Tensor = self.head(h.mean((2, 3)))
        return out


class _AugmentedSupervised(OptimizerSupervised):
    """:class:`OptimizerSupervised` flipping training images left-right at random and shifting them by up to 2
    pixels each way (circularly), drawn from torch's global generator (seeded by the caller)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        flip = torch.rand(len(x)) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
        dy, dx = (int(v) for v in torch.randint(-2, 3, (2,)))
        return self.loss(self.net(x.roll((dy, dx), (2, 3))), y)


def colour_shape_resnet(seed: int) -> Problem:
    """12 x 12 RGB images under pixel noise of spread 0.8 holding a disc or a square (radius 2 to 3.5, random place)
    in a reddish or a bluish colour (random tint); the class is shape x colour, 5 % of labels redrawn (1,536
    images, 1,280 to train); a small ResNet with BatchNorm trained under flip-and-shift augmentation,
    cross-entropy, SGD with momentum 0.9 and weight decay 5e-4, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n, size = 1536, 12
    shape, colour = torch.randint(0, 2, (n,), generator=g), torch.randint(0, 2, (n,), generator=g)
    centre = 3 + 6 * torch.rand(n, 2, 1, 1, generator=g)
    radius = 2 + 1.5 * torch.rand(n, 1, 1, generator=g)
    rows, cols = _grid(size)
    dr, dc = rows - centre[:, 0], cols - centre[:, 1]
    disc = (dr**2 + dc**2 <= radius**2).float()
    square = ((dr.abs() <= radius * 0.85) & (dc.abs() <= radius * 0.85)).float()
    mask = torch.where(shape[:, None, None] == 1, square, disc)
    tint = torch.rand(n, 3, generator=g) * 0.4
    tint[torch.arange(n), 2 * colour] += 0.8
    x = mask.unsqueeze(1) * tint[:, :, None, None] + 0.8 * torch.randn(n, 3, size, size, generator=g)
    train, val = _split(x, _flip(2 * shape + colour, 4, 0.05, g), 1280)
    optimizer = functools.partial(torch.optim.SGD, momentum=0.9, weight_decay=5e-4)
    return Problem("colour-and-shape ResNet + BatchNorm with flip-and-shift augmentation, momentum + weight decay",
                   lambda lr: _AugmentedSupervised(_ResNet(4), nn.functional.cross_entropy, optimizer, lr),
                   train, val, batch_size=64)


TWELFTH_SET: list[Family] = [motif_neox, count_comparison_albert, implicit_feedback_bpr, spiral_score_matching,
                             conditional_flow_matching, regime_top2_experts, hierarchical_softmax, bio_span_cnn,
                             student_t_autoregression, delayed_recall_elman, sorting_pointer_network,
                             colour_shape_resnet]
