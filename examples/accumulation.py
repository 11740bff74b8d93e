"""Gradient accumulation in your own loop: skip the gradient all-reduce on all but the last
micro-batch of each window, and step once per window.

    python examples/accumulation.py
"""

from __future__ import annotations

import torch
from torch import nn

import phalanx

ACCUMULATE = 4


def main() -> None:
    fabric = phalanx.Fabric(accelerator="cpu", devices=2)
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.02))

    generator = torch.Generator().manual_seed(fabric.global_rank)
    steps, window_loss = 0, 0.0
    for micro_batch in range(10 * ACCUMULATE):
        x = torch.randn(8, 16, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        boundary = (micro_batch + 1) % ACCUMULATE == 0
        # Forward and backward inside the block; on the boundary, sync is on (enabled=False).
        with fabric.no_backward_sync(model, enabled=not boundary):
            loss = nn.functional.mse_loss(model(x), y) / ACCUMULATE  # equals the large-batch loss
            fabric.backward(loss)
        window_loss += float(loss)
        if boundary:
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            fabric.print(f"optimizer step {steps:2d}: window loss {window_loss:.4f} (rank 0's shard)")
            window_loss = 0.0
    # Stepping between boundaries would use rank-local gradients; phalanx refuses it:
    with fabric.no_backward_sync(model):
        fabric.backward(model(torch.randn(8, 16)).sum())
    try:
        optimizer.step()
    except phalanx.errors.GradientSyncError as err:
        fabric.print(f"refused as expected: {str(err)[:90]}...")


if __name__ == "__main__":
    main()
