"""The model and data of the parity tests and of their raw-torch and Fabric jobs (tests/integration/test_parity.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def dataset(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x @ torch.randn(8, 1, generator=g)).squeeze(1))


def make_model() -> nn.Module:
    torch.manual_seed(42)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
