"""A Lightning-Fabric-style training loop: setup, setup_dataloaders, backward, clip_gradients,
all_reduce, save/load, the module's own ``self.log`` through Fabric's loggers.

Only the import line differs from a Lightning Fabric script. Random stand-in data.

    python examples/lightning_style/fabric_classifier.py --devices 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx as L
from phalanx.loggers import CSVLogger


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    return TensorDataset(x, (x[:, :4].argmax(1)))  # the label is a function of the input: learnable


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--root", default="runs/lightning_style_fabric")
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=args.devices, loggers=CSVLogger(args.root))
    fabric.launch()
    fabric.seed_everything(1234)
    classifier = Classifier()
    optimizer = torch.optim.SGD(classifier.parameters(), lr=0.1)
    model, optimizer = fabric.setup(classifier, optimizer)
    train, test = fabric.setup_dataloaders(DataLoader(data(1024, 0), batch_size=32, shuffle=True),
                                           DataLoader(data(256, 1), batch_size=64))
    for epoch in range(args.epochs):
        model.train()
        for batch_idx, (x, y) in enumerate(train):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=2.0)
            optimizer.step()
            if batch_idx % 8 == 0:
                classifier.log("train_loss", loss.item())  # a LightningModule logs through Fabric
        model.eval()
        correct = torch.tensor(0)
        with torch.no_grad():
            for x, y in test:
                correct += (model(x).argmax(1) == y).sum()
        accuracy = fabric.all_reduce(correct, reduce_op="sum").item() / len(test.dataset)
        fabric.log("test_acc", accuracy, step=epoch)
    path = Path(args.root) / "classifier.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "epoch": args.epochs})
    state = fabric.load(path, {"model": model, "optimizer": optimizer})
    fabric.print(f"RESULT test_acc={accuracy:.4f} epoch={state['epoch']}")


if __name__ == "__main__":
    main()
