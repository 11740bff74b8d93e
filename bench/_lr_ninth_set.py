"""The ninth set of LR-finder problem families, ``NINTH_SET`` (12): written on 2026-11-29, after the eighth set, by
someone who never ran the LR finder on them nor saw any of its results or logs. Only plain fits on the
learning-rate grid (and the initial loss) were run on them while they were written, to check that each trains,
that its best loss stays well above 0, that its best learning rate lies inside the grid and that a fit is cheap;
never the LR finder.

None repeats an earlier family's kind of data, model or loss. Between them: Adam (1), AdamW (1), plain SGD (2),
SGD with momentum 0.9 (2), SGD with Nesterov momentum 0.9 (1), RMSprop (1), Adagrad (1), NAdam (1), RAdam (1) and
Adamax (1); a weight-tied residual MLP taking Euler steps of a learned vector field (neural-ODE-like) to fit a
dynamical system's flow map, a tiny Hugging Face Llama (rotary positions, RMSNorm, grouped-query attention) as a
causal LM, a small U-Net segmenting under a BCE plus Dice loss, attention-pooled multiple-instance learning, a
network conditioned by FiLM layers, a PixelCNN-style masked-convolution density model of binary images, a temporal
convolutional network with weight normalisation identifying a NARMA system, an affine-coupling normalising flow
(negative log-likelihood), a straight-through Gumbel-softmax discrete autoencoder, a Cox proportional-hazards
survival model (partial likelihood), a BiGRU under a CTC loss and a Mish MLP under the generalised cross-entropy
on noisy labels; three sequence models (the Llama, the TCN and the CTC tagger); with and without BatchNorm,
LayerNorm, RMSNorm, weight normalisation or dropout; batches of 8 to 256. Data are drawn by a ``torch.Generator``
from the seed; every one has label or target noise (or real ambiguity), so the best validation loss stays well
above 0. Validation sets hold at least 256 samples.
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


# ---------------------------------------------------------------------------------------------- dynamics and density
class _EulerFlow(nn.Module):
    """A learned vector field (tanh MLP 2-64-64-2) integrated by ``steps`` Euler steps of size 1/steps: one weight-tied
    residual network, the discretised neural ODE."""

    def __init__(self, steps: int = 8) -> None:
        super().__init__()
        self.steps, self.field = steps, _mlp(2, 64, 64, 2, act=nn.Tanh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.steps):
            x = x + self.field(x) / self.steps
        return x


def van_der_pol_flow(seed: int) -> Problem:
    """States drawn uniformly from [-2.5, 2.5]^2, each carried one time unit along the Van der Pol oscillator (mu 1;
    20 RK4 steps), the end state seen under noise of spread 0.3 the target (1,536 states, 1,024 to train); an
    Euler-stepped learned vector field, mean squared error, plain SGD, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, dt = 1536, 0.05
    start = 5 * torch.rand(n, 2, generator=g) - 2.5

    def velocity(s: torch.Tensor) -> torch.Tensor:
        return torch.stack([s[:, 1], (1 - s[:, 0] ** 2) * s[:, 1] - s[:, 0]], 1)

    state = start
    for _ in range(20):
        k1 = velocity(state)
        k2 = velocity(state + dt / 2 * k1)
        k3 = velocity(state + dt / 2 * k2)
        k4 = velocity(state + dt * k3)
        state = state + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    train, val = _split(start, state + 0.3 * torch.randn(n, 2, generator=g), 1024)
    return Problem("Van der Pol flow map, Euler-stepped vector field (neural ODE), SGD",
                   lambda lr: Supervised(_EulerFlow(), nn.functional.mse_loss, "sgd", lr), train, val)


class _CouplingFlow(nn.Module):
    """A RealNVP-like flow: ``layers`` affine couplings, each scaling and shifting one half of the features by an MLP
    (half-64-64-features, its last layer zero so that the flow starts as the identity) of the other half, the halves
    swapped between layers. It returns the latent point and the log-determinant of the Jacobian per row."""

    def __init__(self, features: int, layers: int = 4) -> None:
        super().__init__()
        nets = [_mlp(features // 2, 64, 64, features) for _ in range(layers)]
        for net in nets:
            for parameter in net[-1].parameters():
                nn.init.zeros_(parameter)
        self.nets = nn.ModuleList(nets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_det = torch.zeros(len(x))
        for net in self.nets:
            kept, moved = x.chunk(2, 1)
            log_scale, shift = net(kept).chunk(2, 1)
            log_scale = torch.tanh(log_scale)  # bounded, so that one step cannot blow a half up
            x = torch.cat([moved * log_scale.exp() + shift, kept], 1)
            log_det = log_det + log_scale.sum(1)
        return torch.cat([x, log_det.unsqueeze(1)], 1)


def _flow_nll(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # Negative log-likelihood under a standard normal base, in nats per feature (its constant included, so that
    # the loss stays positive on these data).
    z, log_det = out[:, :-1], out[:, -1]
    return ((0.5 * z**2 + 0.5 * math.log(2 * math.pi)).sum(1) - log_det).mean() / z.shape[1]


def ring_coupling_flow(seed: int) -> Problem:
    """4-D points: the first two on a ring of radius 2 (radial spread 0.3), the third their product over 2 and the
    fourth the sine of 1.5 times the third, each plus noise of spread 0.3, all shifted by 1 (4,096 points, 3,072 to
    train); an affine-coupling normalising flow, negative log-likelihood, Adagrad, batch 128."""
    g = torch.Generator().manual_seed(seed)
    n = 4096
    angle = 2 * math.pi * torch.rand(n, generator=g)
    radius = 2 + 0.3 * torch.randn(n, generator=g)
    a, b = radius * angle.cos(), radius * angle.sin()
    c = a * b / 2 + 0.3 * torch.randn(n, generator=g)
    d = torch.sin(1.5 * c) + 0.3 * torch.randn(n, generator=g)
    x = torch.stack([a, b, c, d], 1) + 1
    train, val = _split(x, x, 3072)
    return Problem("ring-manifold affine-coupling flow (negative log-likelihood), Adagrad",
                   lambda lr: AdagradSupervised(_CouplingFlow(4), _flow_nll, lr), train, val, batch_size=128)


class _FiLMNet(nn.Module):
    """An MLP 1-64-64-1 on the first input whose two hidden layers are scaled and shifted (FiLM) by a conditioning
    MLP 3-32-256 of the other three inputs."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.first, self.second, self.head = nn.Linear(1, width), nn.Linear(width, width), nn.Linear(width, 1)
        self.film = _mlp(3, 32, 4 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma1, beta1, gamma2, beta2 = self.film(x[:, 1:]).chunk(4, 1)
        h = torch.relu((1 + gamma1) * self.first(x[:, :1]) + beta1)
        h = torch.relu((1 + gamma2) * self.second(h) + beta2)
        out: torch.Tensor = self.head(h)
        return out


def film_sinusoids(seed: int) -> Problem:
    """y = sin(f x + p) + noise of spread 0.2 at x uniform on [-3, 3], each sample's frequency f (0.5 to 2) and phase
    p its own, given as the condition (f centred and scaled, cos p, sin p) (3,072 samples, 2,560 to train); an MLP
    on x modulated by FiLM layers from the condition, mean squared error, SGD with momentum 0.9, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 3072
    x = 6 * torch.rand(n, generator=g) - 3
    frequency = 0.5 + 1.5 * torch.rand(n, generator=g)
    phase = 2 * math.pi * torch.rand(n, generator=g)
    y = torch.sin(frequency * x + phase) + 0.2 * torch.randn(n, generator=g)
    inputs = torch.stack([x, 2 * (frequency - 1.25), phase.cos(), phase.sin()], 1)
    train, val = _split(inputs, y.unsqueeze(1), 2560)
    return Problem("FiLM-conditioned sinusoid MLP, momentum",
                   lambda lr: Supervised(_FiLMNet(), nn.functional.mse_loss, "momentum", lr), train, val,
                   batch_size=64)


# ---------------------------------------------------------------------------------------------- sets, codes, hazards
class _AttentionMIL(nn.Module):
    """Multiple-instance learning: an instance encoder (MLP features-32-32 with dropout 0.1, ReLU), gated attention
    pooling over the bag's instances (tanh and sigmoid branches of 16), a linear head on the pooled bag."""

    def __init__(self, features: int, width: int = 32) -> None:
        super().__init__()
        self.encode = nn.Sequential(_mlp(features, width, width, dropout=0.1), nn.ReLU())
        self.value, self.gate, self.score = nn.Linear(width, 16), nn.Linear(width, 16), nn.Linear(16, 1)
        self.head = nn.Linear(width, 1)

    def forward(self, bags: torch.Tensor) -> torch.Tensor:
        h = self.encode(bags)
        weights = self.score(torch.tanh(self.value(h)) * torch.sigmoid(self.gate(h))).softmax(1)
        out: torch.Tensor = self.head((weights * h).sum(1))
        return out


def witness_mil(seed: int) -> Problem:
    """Bags of 12 instances of 6 features, each instance from one of 5 overlapping Gaussian clusters (centres of
    spread 1.5, unit noise); a bag is positive when it holds an instance of the witness cluster (drawn with the
    probability that makes half the bags positive), 10 % of labels flipped (1,024 bags, 768 to train); gated
    attention-pooling MIL with dropout, binary cross-entropy, RMSprop, batch 8."""
    g = torch.Generator().manual_seed(seed)
    n, size = 1024, 12
    centres = 1.5 * torch.randn(5, 6, generator=g)
    witness = torch.rand(n, size, generator=g) < 1 - 0.5 ** (1 / size)
    cluster = torch.where(witness, 0, torch.randint(1, 5, (n, size), generator=g))
    bags = centres[cluster] + torch.randn(n, size, 6, generator=g)
    label = _flip(witness.any(1).long(), 2, 0.2, g).float()  # redrawn with probability 0.2: 10 % flipped
    train, val = _split(bags, label, 768)
    return Problem("witness-instance attention MIL + dropout, RMSprop",
                   lambda lr: RMSpropSupervised(_AttentionMIL(6), _binary_cross_entropy, lr), train, val,
                   batch_size=8)


class _GumbelAutoencoder(nn.Module):
    """An encoder (MLP features-64-codes with LayerNorm) picks one of ``codes`` codes, by a straight-through
    Gumbel-softmax sample while training and by its argmax otherwise; a decoder (MLP codes-64-features) reconstructs
    from the one-hot code."""

    def __init__(self, features: int, codes: int) -> None:
        super().__init__()
        self.encoder = _mlp(features, 64, codes, norm=nn.LayerNorm)
        self.decoder = _mlp(codes, 64, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.encoder(x)
        if self.training:  # the Gumbel noise comes from torch's generator, seeded by the fit
            code = nn.functional.gumbel_softmax(logits, tau=1.0, hard=True)
        else:
            code = nn.functional.one_hot(logits.argmax(1), logits.shape[1]).float()
        out: torch.Tensor = self.decoder(code)
        return out


def gumbel_codebook(seed: int) -> Problem:
    """16 features from a mixture of 12 Gaussian clusters (centres of unit spread, noise of spread 0.5; 2,560 points,
    2,048 to train) squeezed through one of only 8 discrete codes; a straight-through Gumbel-softmax autoencoder with
    LayerNorm, mean squared reconstruction error, RAdam, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 2560
    centres = torch.randn(12, 16, generator=g)
    x = centres[torch.randint(0, 12, (n,), generator=g)] + 0.5 * torch.randn(n, 16, generator=g)
    train, val = _split(x, x, 2048)
    return Problem("Gumbel-softmax discrete autoencoder + LayerNorm, RAdam",
                   lambda lr: OptimizerSupervised(_GumbelAutoencoder(16, 8), nn.functional.mse_loss,
                                                  torch.optim.RAdam, lr), train, val, batch_size=64)


def _cox_partial_nll(risk: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Breslow's partial likelihood within the batch: each event's log-risk against the log-sum over everyone whose
    # time is no earlier (sorted by descending time, a running logsumexp), averaged over the batch's events.
    order = y[:, 0].argsort(descending=True)
    risk, event = risk.squeeze(1)[order], y[order, 1]
    return -((risk - torch.logcumsumexp(risk, 0)) * event).sum() / event.sum().clamp(min=1)


def cox_survival(seed: int) -> Problem:
    """10 Gaussian features; a log-hazard from a random tanh teacher, standardised and scaled to spread 2.5;
    exponential event times under it, censored by independent exponential times (about a third censored; 3,072
    patients, 2,560 to train); an MLP 10-32-1 giving the log-risk, Cox partial likelihood, plain SGD, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 3072
    x = torch.randn(n, 10, generator=g)
    log_hazard = 2.5 * _standardised(torch.tanh(x @ torch.randn(10, 16, generator=g) / 2)
                                     @ torch.randn(16, 1, generator=g)).squeeze(1)
    event_time = -torch.rand(n, generator=g).log() / log_hazard.exp()
    censor_time = -torch.rand(n, generator=g).log() * 2 * event_time.median()
    y = torch.stack([event_time.minimum(censor_time), (event_time <= censor_time).float()], 1)
    train, val = _split(x, y, 2560)
    return Problem("Cox proportional-hazards survival MLP (partial likelihood), SGD",
                   lambda lr: Supervised(_mlp(10, 32, 1), _cox_partial_nll, "sgd", lr), train, val, batch_size=64)


def _generalised_cross_entropy(logits: torch.Tensor, y: torch.Tensor, q: float = 0.7) -> torch.Tensor:
    # Zhang and Sabuncu's loss, (1 - p_y^q) / q: between cross-entropy (q -> 0) and the mean absolute error (q = 1),
    # robust to wrong labels.
    p = logits.softmax(1).gather(1, y.unsqueeze(1)).squeeze(1)
    return ((1 - p.clamp(min=1e-12) ** q) / q).mean()


def noisy_labels_gce(seed: int) -> Problem:
    """5 classes from a random tanh teacher on 12 Gaussian features, a third of the labels (training and
    validation) redrawn uniformly (8,192 samples, 7,680 to train); MLP 12-128-128-5 with Mish, generalised
    cross-entropy (q 0.7), SGD with momentum 0.9, batch 256."""
    g = torch.Generator().manual_seed(seed)
    n = 8192
    x = torch.randn(n, 12, generator=g)
    label = (torch.tanh(x @ torch.randn(12, 32, generator=g) / 2) @ torch.randn(32, 5, generator=g)).argmax(1)
    train, val = _split(x, _flip(label, 5, 1 / 3, g), 7680)
    return Problem("noisy-label Mish MLP (generalised cross-entropy), momentum",
                   lambda lr: Supervised(_mlp(12, 128, 128, 5, act=nn.Mish), _generalised_cross_entropy, "momentum",
                                         lr), train, val, batch_size=256)


# ---------------------------------------------------------------------------------------------- images
def _conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class _TinyUNet(nn.Module):
    """A two-level U-Net: 3x3 convolutions with BatchNorm at 16x16 (8 channels) and 8x8 (16), a transposed
    convolution back up, the skip connection concatenated, and a per-pixel logit."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.bottom = _conv_bn(1, 8), nn.Sequential(nn.MaxPool2d(2), _conv_bn(8, 16))
        self.up, self.fuse = nn.ConvTranspose2d(16, 8, 2, stride=2), _conv_bn(16, 8)
        self.head = nn.Conv2d(8, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down(x)
        out: torch.Tensor = self.head(self.fuse(torch.cat([skip, self.up(self.bottom(skip))], 1)))
        return out


def _bce_dice(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Per-pixel binary cross-entropy plus the soft Dice loss over the batch (smoothed by 1).
    p = torch.sigmoid(logits)
    dice = 1 - (2 * (p * mask).sum() + 1) / (p.sum() + mask.sum() + 1)
    return nn.functional.binary_cross_entropy_with_logits(logits, mask) + dice


def disc_unet(seed: int) -> Problem:
    """16x16 images of 1 to 3 discs (radius 1.5 to 3.5, brightness 0.5 to 1.5) on a random linear background
    ramp, under pixel noise of spread 0.8; the discs' mask the target (1,792 images, 1,536 to train); a small U-Net
    with BatchNorm, per-pixel binary cross-entropy plus Dice loss, Adam, batch 64."""
    g = torch.Generator().manual_seed(seed)
    n = 1792
    rows, cols = _grid(16)
    mask = torch.zeros(n, 16, 16, dtype=torch.bool)
    image = torch.zeros(n, 16, 16)
    count = torch.randint(1, 4, (n, 1, 1), generator=g)
    for k in range(3):
        centre = 2 + 12 * torch.rand(n, 2, 1, 1, generator=g)
        radius = 1.5 + 2 * torch.rand(n, 1, 1, generator=g)
        disc = ((rows - centre[:, 0]) ** 2 + (cols - centre[:, 1]) ** 2 <= radius**2) & (count > k)
        mask |= disc
        image = torch.maximum(image, disc * (0.5 + torch.rand(n, 1, 1, generator=g)))
    ramp = torch.randn(n, 2, 1, 1, generator=g) / 16
    image = image + ramp[:, 0] * (rows - 7.5) + ramp[:, 1] * (cols - 7.5) + 0.8 * torch.randn(n, 16, 16, generator=g)
    train, val = _split(image.unsqueeze(1), mask.unsqueeze(1).float(), 1536)
    return Problem("disc-segmentation U-Net + BatchNorm (BCE + Dice), Adam",
                   lambda lr: Supervised(_TinyUNet(), _bce_dice, "adam", lr), train, val, batch_size=64)


class _MaskedConv(nn.Conv2d):
    """A convolution that sees only the pixels before the centre in raster order (and the centre too unless
    ``strict``): PixelCNN's mask A (``strict``) and mask B."""

    mask: torch.Tensor

    def __init__(self, cin: int, cout: int, kernel: int, strict: bool) -> None:
        super().__init__(cin, cout, kernel, padding=kernel // 2)
        mask = torch.ones_like(self.weight)
        mask[..., kernel // 2, kernel // 2 + (0 if strict else 1):] = 0
        mask[..., kernel // 2 + 1:, :] = 0
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._conv_forward(x, self.weight * self.mask, self.bias)
        return out


def rectangles_pixelcnn(seed: int) -> Problem:
    """12x12 binary images of 1 or 2 filled rectangles (sides 3 to 7) at random places, 4 % of pixels flipped
    (1,536 images, 1,280 to train); a PixelCNN (a 5x5 mask-A convolution, two 3x3 mask-B ones of 16 channels, ReLU,
    a 1x1 head), per-pixel binary cross-entropy (the autoregressive negative log-likelihood), Adamax, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n = 1536
    rows, cols = _grid(12)
    image = torch.zeros(n, 12, 12, dtype=torch.bool)
    for k in range(2):
        size = torch.randint(3, 8, (n, 2, 1, 1), generator=g)
        corner = (torch.rand(n, 2, 1, 1, generator=g) * (13 - size)).floor()
        inside = ((rows >= corner[:, 0]) & (rows < corner[:, 0] + size[:, 0]) & (cols >= corner[:, 1])
                  & (cols < corner[:, 1] + size[:, 1]))
        image |= inside & ((k == 0) | (torch.rand(n, 1, 1, generator=g) < 0.5))
    image ^= torch.rand(n, 12, 12, generator=g) < 0.04
    x = image.unsqueeze(1).float()
    train, val = _split(x, x, 1280)

    def make(lr: float) -> phalanx.Module:
        net = nn.Sequential(_MaskedConv(1, 16, 5, strict=True), nn.ReLU(), _MaskedConv(16, 16, 3, strict=False),
                            nn.ReLU(), _MaskedConv(16, 16, 3, strict=False), nn.ReLU(), nn.Conv2d(16, 1, 1))
        return OptimizerSupervised(net, nn.functional.binary_cross_entropy_with_logits, torch.optim.Adamax, lr)

    return Problem("binary-rectangles PixelCNN (masked convolutions), Adamax", make, train, val)


# ---------------------------------------------------------------------------------------------- sequences
class _WeightNormTCN(nn.Module):
    """A temporal convolutional network: a 1x1 stem to 24 channels, three residual causal convolutions of kernel 3
    and dilations 1, 2, 4 (ReLU, dropout 0.1), each under weight normalisation, and a 1x1 head."""

    def __init__(self, channels: int = 24) -> None:
        super().__init__()
        weight_norm = nn.utils.parametrizations.weight_norm
        self.dilations = (1, 2, 4)
        self.stem = nn.Conv1d(1, channels, 1)
        self.convs = nn.ModuleList(weight_norm(nn.Conv1d(channels, channels, 3, dilation=d)) for d in self.dilations)
        self.dropout, self.head = nn.Dropout(0.1), nn.Conv1d(channels, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for dilation, conv in zip(self.dilations, self.convs, strict=True):
            h = h + self.dropout(torch.relu(conv(nn.functional.pad(h, (2 * dilation, 0)))))  # causal: left padding
        out: torch.Tensor = self.head(h)
        return out


def narma_tcn(seed: int) -> Problem:
    """Inputs u uniform on [0, 0.5] drive the NARMA-10 system y' = 0.3 y + 0.05 y (sum of the last 10 y) + 1.5
    u_-9 u + 0.1; series of 64 steps after a burn-in of 20, y standardised and seen under noise of spread 0.2, the
    target at each step from the inputs so far (1,024 series, 768 to train); a weight-normalised TCN with dropout,
    mean squared error, SGD with Nesterov momentum 0.9, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, burn_in, length = 1024, 20, 64
    u = 0.5 * torch.rand(n, burn_in + length, generator=g)
    y = torch.zeros(n, burn_in + length + 1)
    for t in range(burn_in + length):
        recent = y[:, max(0, t - 9):t + 1].sum(1)
        drive = 1.5 * u[:, t - 9] * u[:, t] if t >= 9 else 0.0
        y[:, t + 1] = 0.3 * y[:, t] + 0.05 * y[:, t] * recent + drive + 0.1
    target = _standardised(y[:, burn_in + 1:].reshape(-1, 1)).view(n, 1, length)
    target = target + 0.2 * torch.randn(n, 1, length, generator=g)
    train, val = _split(u[:, None, burn_in:], target, 768)
    return Problem("NARMA-10 weight-normalised TCN + dropout, Nesterov",
                   lambda lr: NesterovSupervised(_WeightNormTCN(), nn.functional.mse_loss, lr), train, val)


class _Llama(nn.Module):
    """A tiny ``transformers`` Llama built from its config (2 layers, width 32, 4 query and 2 key-value heads,
    feed-forward 64, rotary positions, RMSNorm), returning the next-token logits."""

    def __init__(self, vocab: int, context: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=context, bos_token_id=0, eos_token_id=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids=x).logits
        return out


def sorted_llama(seed: int) -> Problem:
    """Sequences of 17 tokens: 17 uniform draws from 24 sorted into ascending order, 10 % of tokens then replaced
    by uniform ones (1,024 sequences, 768 to train); a tiny Hugging Face Llama (``LlamaForCausalLM`` from a config)
    as a next-token LM, AdamW, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab = 1024, 17, 24
    seqs = torch.randint(0, vocab, (n, length), generator=g).sort(1).values
    seqs = torch.where(torch.rand(n, length, generator=g) < 0.1, torch.randint(0, vocab, (n, length), generator=g),
                       seqs)
    train, val = _split(seqs[:, :-1], seqs[:, 1:], 768)
    return Problem("sorted-sequence Hugging Face Llama LM, AdamW",
                   lambda lr: Supervised(_Llama(vocab, length - 1), token_cross_entropy, "adamw", lr), train, val)


class _CTCTagger(nn.Module):
    """A 3-wide 1-D convolution to 32 channels (ReLU), a bidirectional GRU of 32 units each way and a linear head over
    the symbols and the blank (0), per frame."""

    def __init__(self, features: int, symbols: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(features, 32, 3, padding=1)
        self.rnn = nn.GRU(32, 32, batch_first=True, bidirectional=True)
        self.head = nn.Linear(64, symbols + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2))
        out: torch.Tensor = self.head(hidden)
        return out


def _ctc(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Targets padded with the blank (0); every input uses all its frames. The mean over targets of the loss divided
    # by the target's length.
    log_probs = logits.log_softmax(2).transpose(0, 1)
    return nn.functional.ctc_loss(log_probs, y, torch.full((len(y),), len(log_probs)), (y > 0).sum(1),
                                  zero_infinity=True)


def segments_ctc(seed: int) -> Problem:
    """Sequences of 24 frames of 8 features: 2 to 4 symbols from 6 (no symbol twice in a row), each held for 2 to 4
    frames of its own random prototype under noise of spread 1, separated by 0 to 2 silent frames (noise only); the
    symbols the target, 15 % of them replaced by another symbol (1,024 sequences, 768 to
    train); a convolution and bidirectional GRU, CTC loss, NAdam, batch 32."""
    g = torch.Generator().manual_seed(seed)
    n, frames, symbols = 1024, 24, 6
    prototypes = torch.cat([torch.zeros(1, 8), 1.5 * torch.randn(symbols, 8, generator=g)])
    x = torch.zeros(n, frames, dtype=torch.long)
    y = torch.zeros(n, 4, dtype=torch.long)
    counts = torch.randint(2, 5, (n,), generator=g).tolist()
    holds = torch.randint(2, 5, (n, 4), generator=g).tolist()
    gaps = torch.randint(0, 3, (n, 4), generator=g).tolist()
    shifts = torch.randint(1, symbols, (n, 4), generator=g).tolist()
    first = torch.randint(1, symbols + 1, (n,), generator=g).tolist()
    for i in range(n):
        at, symbol = 0, first[i]
        for k in range(counts[i]):
            if k:
                symbol = (symbol - 1 + shifts[i][k]) % symbols + 1
            y[i, k] = symbol
            x[i, at:at + holds[i][k]] = symbol
            at += holds[i][k] + gaps[i][k]
    wrong = (torch.rand(n, 4, generator=g) < 0.15) & (y > 0)
    y = torch.where(wrong, (y - 1 + torch.randint(1, symbols, (n, 4), generator=g)) % symbols + 1, y)
    features = prototypes[x] + torch.randn(n, frames, 8, generator=g)
    train, val = _split(features, y, 768)
    return Problem("segment-transcription BiGRU (CTC loss), NAdam",
                   lambda lr: OptimizerSupervised(_CTCTagger(8, symbols), _ctc, torch.optim.NAdam, lr), train, val)


NINTH_SET: list[Family] = [van_der_pol_flow, ring_coupling_flow, film_sinusoids, witness_mil, gumbel_codebook,
                           cox_survival, noisy_labels_gce, disc_unet, rectangles_pixelcnn, narma_tcn, sorted_llama,
                           segments_ctc]
