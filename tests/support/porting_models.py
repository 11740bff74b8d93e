"""Lightning-shaped modules and data of the porting tests and of their 2-rank jobs
(tests/integration/test_porting.py, test_porting_dist.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as L


def data(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class TwoOptimizers(L.LightningModule):
    """A GAN-shaped loop: two optimizers, toggled, stepped by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.gen = nn.Linear(4, 4)
        self.disc = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_d)
        assert all(not p.requires_grad for p in self.gen.parameters())
        d_loss = self.disc(x).pow(2).mean() + self.disc(self.gen(x).detach()).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        with self.toggled_optimizer(opt_g):
            g_loss = -self.disc(self.gen(x)).mean()
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            self.clip_gradients(opt_g, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt_g.step()
        sched = self.lr_schedulers()
        sched.step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.SGD(self.gen.parameters(), lr=0.05)
        opt_d = torch.optim.SGD(self.disc.parameters(), lr=0.05)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, 1, gamma=0.5)]


def manual_reference(batches: list[Any]) -> nn.Module:
    ref = TwoOptimizers()
    opt_g = torch.optim.SGD(ref.gen.parameters(), lr=0.05)
    opt_d = torch.optim.SGD(ref.disc.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt_g, 1, gamma=0.5)
    for x, _ in batches:
        for p in ref.gen.parameters():
            p.requires_grad_(False)
        d_loss = ref.disc(x).pow(2).mean() + ref.disc(ref.gen(x).detach()).mean()
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        for p in ref.gen.parameters():
            p.requires_grad_(True)
        for p in ref.disc.parameters():
            p.requires_grad_(False)
        g_loss = -ref.disc(ref.gen(x)).mean()
        opt_g.zero_grad()
        g_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.gen.parameters(), 1.0)
        opt_g.step()
        for p in ref.disc.parameters():
            p.requires_grad_(True)
        sched.step()
    return ref
