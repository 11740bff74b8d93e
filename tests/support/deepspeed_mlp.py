"""The small MLP of the DeepSpeed jobs (tests/support/jobs/deepspeed_*.py): per-rank micro-batches of one
global batch, and the single-process reference that trains on the concatenation of everything the ranks saw
in each window."""

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

import phalanx
from phalanx.strategies import DeepSpeedStrategy

W, N, B = 2, 3, 2

class CountingSGD(torch.optim.SGD):
    calls = 0
    def step(self, closure: Any = None) -> Any:
        CountingSGD.calls += 1
        return super().step(closure)

def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

def batches(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(steps, N, W, B, 4, generator=g), torch.randn(steps, N, W, B, 1, generator=g)

def train(fabric: phalanx.Fabric, model: Any, opt: Any, X: torch.Tensor, Y: torch.Tensor, steps: Iterable[int],
          world: int = W) -> None:
    r = fabric.global_rank
    for s in steps:
        for m in range(N):
            with fabric.no_backward_sync(model, enabled=m < N - 1):
                xs = X[s, m].reshape(world, -1, 4)[r]
                ys = Y[s, m].reshape(world, -1, 1)[r]
                fabric.backward(nn.functional.mse_loss(model(xs), ys) / N)
        opt.step()
        opt.zero_grad()

def reference(steps: int, X: torch.Tensor, Y: torch.Tensor) -> nn.Sequential:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        nn.functional.mse_loss(model(X[s].reshape(-1, 4)), Y[s].reshape(-1, 1)).backward()
        opt.step()
        opt.zero_grad()
    return model

def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for v in state.values()])

def strategy_from(name: str) -> DeepSpeedStrategy | str:
    return DeepSpeedStrategy(stage=int(name[-1])) if name.startswith("deepspeed") else name
