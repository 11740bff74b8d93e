"""A 2-rank DDP Fabric loop in which rank 1, or both ranks, raise at step 2.

argv: how the ranks start (``script``: ``fabric.launch()``, ``function``: ``fabric.launch(train)``, ``run``:
under ``phalanx run``), and who raises (``rank1`` or ``both``). Run by tests/distributed/test_failure_output.py.
"""

import sys

import torch

import phalanx

HOW, WHO = sys.argv[1], sys.argv[2]


def train(fabric: phalanx.Fabric) -> None:
    model = torch.nn.Linear(4, 1)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(4):
        print(f"rank {fabric.global_rank} step {step}", flush=True)
        loss = model(torch.randn(8, 4)).sum()
        if step == 2 and (WHO == "both" or fabric.global_rank == 1):
            raise ValueError(f"bad batch at step {step}")  # the line the summary names
        fabric.backward(loss)
        opt.step()


if HOW == "script":
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    train(fabric)
elif HOW == "function":
    if __name__ == "__main__":
        phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp").launch(train)
else:
    fabric = phalanx.Fabric(accelerator="cpu")
    fabric.launch()
    train(fabric)
