"""The container model and data of the FSDP container test and of its job (tests/strategies/test_fsdp_container.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def make_model() -> nn.ModuleDict:
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "teacher": nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)),
        "student": nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)),
    })
    model["teacher"].requires_grad_(False)
    return model


def make_data(n: int = 32) -> torch.Tensor:
    return torch.randn(n, 6, generator=torch.Generator().manual_seed(1))


def loss_of(model: Any, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        target = model["teacher"](x).softmax(-1)
    return nn.functional.kl_div(model.student(x).log_softmax(-1), target, reduction="batchmean")
