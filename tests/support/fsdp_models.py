"""The models and data of the FSDP jobs and of their single-process references (tests/strategies/test_fsdp.py,
test_fsdp_checkpoint.py, test_fsdp_hybrid.py)."""

from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.l1 = nn.Linear(d, 2 * d)
        self.l2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> Any:
        return x + self.l2(torch.tanh(self.l1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Teacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> Any:
        return self.proj(x)


class Distill(nn.Module):
    """A trainable student (a Net) next to a frozen teacher."""
    def __init__(self) -> None:
        super().__init__()
        self.student = Net()
        self.teacher = Teacher()
        self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> Any:
        return self.student(x)


def make_model(cls: type[nn.Module] = Net) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def make_data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def full(t: Any) -> Any:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().reshape(-1).double().cpu()


def full_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([full(p) for p in model.parameters()])


def full_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([full(p.grad) if p.grad is not None else torch.zeros(p.numel()).double()
                      for p in model.parameters()])
