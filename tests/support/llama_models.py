"""A Llama-style decoder (RMSNorm, rotary positions, SwiGLU, no biases, untied output head) and learnable token
data, for the fp8 tests (tests/precision/test_fp8.py and its jobs) and bench/gpu_check.py's fp8 rows.

Every projection is an ``nn.Linear`` with dimensions divisible by 16, so ``precision="fp8-mixed"`` converts all of
them but the output head (``output``, the model's last Linear), as torchtitan does. The blocks sit in an
``nn.ModuleList``: FSDP shards each as its own unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 64
    dim: int = 32
    layers: int = 2
    heads: int = 2
    hidden: int = 64  # the SwiGLU width
    seq: int = 16


#: bench/gpu_check.py's model: large enough that float8 matmuls pay for their casts (about 0.9 B parameters).
BENCH = LlamaConfig(vocab=32000, dim=2048, layers=16, heads=16, hidden=5632, seq=2048)


def rotary(seq: int, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin of the rotary angles, ``(2, seq, head_dim // 2)``."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    cos, sin = rope[0].to(x.dtype), rope[1].to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        out: torch.Tensor = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return out


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig = LlamaConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Computed per call (not a buffer): the model may be created on the meta device.
        rope = rotary(tokens.shape[1], self.cfg.dim // self.cfg.heads, tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, rope)
        out: torch.Tensor = self.output(self.norm(h))
        return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def markov_tokens(cfg: LlamaConfig, batches: int, batch: int, seed: int = 0, successors: int = 4) -> torch.Tensor:
    """``(batches, batch, seq + 1)`` tokens from a fixed random chain where each token has ``successors``
    equally likely next tokens: learnable (the best loss is ln(successors)), unlike uniform noise."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, cfg.vocab, (cfg.vocab, successors), generator=g)
    tokens = torch.empty(batches * batch, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (batches * batch,), generator=g)
    for t in range(cfg.seq):
        pick = torch.randint(0, successors, (batches * batch,), generator=g)
        tokens[:, t + 1] = table[tokens[:, t], pick]
    return tokens.view(batches, batch, cfg.seq + 1)


def split(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of a ``(batch, seq + 1)`` block."""
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_llama(cfg: LlamaConfig = LlamaConfig(), seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(cfg)


def flat_params(module: nn.Module) -> torch.Tensor:
    """Every parameter, full (DTensors gathered), float32, in one vector."""
    out: list[Any] = []
    for p in module.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().float().reshape(-1))
    return torch.cat(out)
