"""An FSDPStrategy object passed through fabric.launch(fn) trains, saves and loads.

Run by tests/strategies/test_strategy_pickle.py.
"""

from typing import Any

import torch
from job_runner import report
from torch import nn

import phalanx
from phalanx.strategies import FSDPStrategy


def work(fabric: phalanx.Fabric) -> Any:
    fabric.seed_everything(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for _step in range(3):
        x = torch.randn(4, 8)
        loss = model(x).float().pow(2).mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach().float(), reduce_op="mean")))
    fabric.save("ckpt", {"model": model, "optimizer": opt})
    with torch.no_grad():
        before = [p.full_tensor().clone() for p in model.parameters()]
        for p in model.parameters():
            p.zero_()
    fabric.load("ckpt", {"model": model, "optimizer": opt})
    after = [p.full_tensor() for p in model.parameters()]
    report(fabric, losses=losses, same=all(torch.equal(a, b) for a, b in zip(before, after)))
    return fabric.global_rank

if __name__ == "__main__":
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, precision="bf16-mixed",
                            strategy=FSDPStrategy(async_save=False, reshard_after_forward=True))
    print("result", fabric.launch(work))
