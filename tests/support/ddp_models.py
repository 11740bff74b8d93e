"""The models and data of the DDP jobs and of their single-process references (tests/strategies/test_ddp.py)."""

from typing import Any

import torch
from torch import nn


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

def make_data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)

class Distill(nn.ModuleDict):
    """A frozen teacher and a trainable student; `distill` is a custom method."""
    def __init__(self) -> None:
        torch.manual_seed(0)
        student = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        super().__init__({"teacher": nn.Linear(6, 3), "student": student})
        self["teacher"].requires_grad_(False)

    def distill(self, x: torch.Tensor) -> Any:
        with torch.no_grad():
            t = self["teacher"](x)
        return ((self["student"](x) - t) ** 2).mean()
