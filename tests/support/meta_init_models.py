"""The models of the meta-init job and of its single-process reference (tests/strategies/test_meta_init.py)."""

import math
from typing import Any

import torch
from torch import nn


class LoRALinear(nn.Module):
    """LitGPT's LoRA layer in small: lora_A drawn (kaiming), lora_B zero; the base Linear its own module."""

    def __init__(self, d_in: int, d_out: int, r: int = 3) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.lora_A = nn.Parameter(torch.empty(r, d_in))
        self.lora_B = nn.Parameter(torch.empty(d_out, r))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> Any:
        return self.linear(x) + x @ self.lora_A.T @ self.lora_B.T


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList([LoRALinear(6, 6), LoRALinear(6, 6)])
        self.norm = nn.BatchNorm1d(6)  # parameters and buffers
        self.head = nn.Linear(6, 5)  # 5 rows over 2 ranks: uneven shards

    def forward(self, x: torch.Tensor) -> Any:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))
