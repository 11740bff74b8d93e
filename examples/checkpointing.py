"""Save and resume: modules, optimizers, schedulers and plain values in one atomic file.

    python examples/checkpointing.py          # trains 3 epochs, saves after each
    python examples/checkpointing.py --resume # continues from the last checkpoint
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import phalanx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--dir", default="runs/checkpointing")
    args = parser.parse_args()

    fabric = phalanx.Fabric(accelerator="cpu", devices=2)
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup(nn.Linear(10, 1))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "epoch": 0}

    path = Path(args.dir) / "last.ckpt"
    if args.resume:
        extra = fabric.load(path, state)  # restores everything in place, on every rank
        fabric.print(f"resumed at epoch {state['epoch']}, lr {scheduler.get_last_lr()[0]:.4f}, extra: {extra}")

    for epoch in range(state["epoch"], state["epoch"] + 3):
        x = torch.randn(32, 10)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        scheduler.step()
        state["epoch"] = epoch + 1
        # Every rank calls save; rank 0 writes; the file appears atomically when complete.
        fabric.save(path, {**state, "note": "saved by examples/checkpointing.py"})
        fabric.print(f"epoch {epoch + 1}: loss {float(loss):.3f} -> {path}")


if __name__ == "__main__":
    main()
