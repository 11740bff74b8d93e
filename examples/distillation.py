"""Distillation under DDP: a frozen teacher and a trainable student in one ModuleDict, with the
student called directly (``model.student(x)``), which plain DDP silently leaves unsynchronized.

phalanx makes the gradients identical on every rank; this script checks it each step.

    python examples/distillation.py
"""

from __future__ import annotations

import torch
from torch import nn

import phalanx
from phalanx.strategies import DDPStrategy


def main() -> None:
    # verify_sync=True: after every backward, compare gradients across ranks (a debugging aid).
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(verify_sync=True))
    fabric.launch()
    fabric.seed_everything(0)

    model = nn.ModuleDict({
        "teacher": nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
        "student": nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10)),
    })
    model["teacher"].requires_grad_(False)
    optimizer = torch.optim.Adam(model["student"].parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)

    generator = torch.Generator().manual_seed(fabric.global_rank)  # each rank its own data
    for step in range(20):
        x = torch.randn(64, 32, generator=generator)
        with torch.no_grad():
            soft_targets = model.teacher(x).softmax(-1)
        log_probs = model.student(x).log_softmax(-1)
        loss = nn.functional.kl_div(log_probs, soft_targets, reduction="batchmean")
        optimizer.zero_grad()
        fabric.backward(loss)  # grads averaged across ranks even though DDP's forward was bypassed
        optimizer.step()
        if step % 5 == 0:
            fabric.print(f"step {step:2d}  kl {float(fabric.all_reduce(loss.detach())):.4f}")
    fabric.verify_in_sync(model)  # parameters too: identical on both ranks
    fabric.print("student replicas identical on all ranks")


if __name__ == "__main__":
    main()
