"""Your own training loop on 2 processes (DDP, CPU) with phalanx.Fabric.

Data: scikit-learn's bundled handwritten digits (1797 8x8 images, no download).

    python examples/fabric_digits.py                 # re-runs itself in 2 processes
    phalanx run --devices 2 examples/fabric_digits.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx


def digits_datasets(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--out", default="runs/fabric_digits")
    args = parser.parse_args()

    fabric = phalanx.Fabric(accelerator="cpu", devices=args.devices, strategy="ddp", precision=args.precision)
    fabric.launch()
    fabric.seed_everything(42)

    train_set, val_set = digits_datasets()
    train_loader = DataLoader(train_set, batch_size=32, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=128)
    train_loader = fabric.setup_dataloaders(train_loader)
    # Validation is small: every rank scores the whole set, so the accuracy is exact (no sampler padding).
    val_loader = fabric.setup_dataloaders(val_loader, use_distributed_sampler=False)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)

    for epoch in range(args.epochs):
        model.train()
        total, count = torch.zeros(()), 0
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            total += loss.detach() * len(y)
            count += len(y)
        scheduler.step()
        # Every rank saw a different shard: the epoch loss is the mean over all of them.
        sums = fabric.all_reduce(torch.stack([total, torch.tensor(float(count))]), reduce_op="sum")
        fabric.print(f"epoch {epoch + 1:2d}  train loss {float(sums[0] / sums[1]):.4f}")

    model.eval()
    correct = torch.zeros(())
    with torch.no_grad():
        for x, y in val_loader:
            correct += (model(x).argmax(1) == y).sum()
    accuracy = float(correct) / len(val_set)
    fabric.print(f"validation accuracy {accuracy:.2%} on {len(val_set)} held-out images")

    out = Path(args.out)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "epoch": args.epochs}
    fabric.save(out / "last.ckpt", state)
    fabric.print(f"checkpoint written to {out / 'last.ckpt'}")


if __name__ == "__main__":
    main()
