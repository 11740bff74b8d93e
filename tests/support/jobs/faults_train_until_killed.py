"""A 2-rank DDP loop in which one rank SIGKILLs itself (run by tests/distributed/test_faults.py).

argv: the rank that dies (-1: none), the step at which it dies, and where (forward, backward or step). Each rank
touches ``ready<rank>`` at step 2; the dying rank writes the time of its death to ``killed_at``.
"""

import os
import signal
import sys
import time

import torch

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2)
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt = fabric.setup(model, opt)
VICTIM, KILL_STEP, WHERE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


def die() -> None:
    with open("killed_at", "w") as fh:
        fh.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


for step in range(10_000):
    killing = fabric.global_rank == VICTIM and step == KILL_STEP
    if step == 2:
        open(f"ready{fabric.global_rank}", "w").close()
    loss = model(torch.randn(8, 16)).pow(2).mean()
    if killing and WHERE == "forward":
        die()
    if killing and WHERE == "backward":
        # Dies inside autograd, while DDP's reducer may already be all-reducing the first buckets.
        model.module[0].weight.register_hook(lambda g: die())
    fabric.backward(loss)
    if killing and WHERE == "step":
        die()
    opt.step()
    opt.zero_grad()
