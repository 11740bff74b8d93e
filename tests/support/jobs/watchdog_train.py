"""A 2-rank DDP loop of argv[1] steps (run by tests/distributed/test_watchdog.py); each rank marks ``ready<rank>``
at step 2. argv[2] says what goes wrong: ``freeze`` (rank 1 marks ``stopped1`` and SIGSTOPs itself at step 5, as a
debugger or a stuck data worker would: alive and silent) or ``raw_all_reduce`` (after the loop rank 0 makes a raw
torch.distributed call that rank 1 never makes).
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import phalanx

STEPS, WHAT = int(sys.argv[1]), sys.argv[2]
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt = fabric.setup(model, opt)
rank = fabric.global_rank


def mark(name: str) -> None:
    with open(f"{name}{rank}", "w") as fh:
        fh.write(repr(time.time()))


for step in range(STEPS):
    if step == 2:
        mark("ready")
    if WHAT == "freeze" and rank == 1 and step == 5:
        mark("stopped")
        os.kill(os.getpid(), signal.SIGSTOP)
    loss = model(torch.randn(8, 16)).pow(2).mean()
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
if WHAT == "raw_all_reduce" and rank == 0:
    dist.all_reduce(torch.ones(3))
