"""Saves every step until killed, on fsdp or on hybrid sharding (argv[1]).

Run by tests/strategies/test_fsdp_checkpoint.py: kill_trial.
"""

import os
import sys
from pathlib import Path

import torch
from torch import nn

import phalanx

torch.set_num_threads(1)
STRATEGY = sys.argv[1]  # a registered strategy name
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=STRATEGY)
fabric.launch()
Path(f"pid{fabric.global_rank}").write_text(str(os.getpid()))
model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters()))
model(torch.randn(2, 512)).sum().backward()
opt.step()

def fill(step):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))

def save(step):
    fill(step)
    handle = fabric.save("ckpt", {"model": model, "optimizer": opt, "step": step})
    fill(-step)  # training overwrites the parameters while an asynchronous write runs: its copy must not see it
    return handle

first = save(1)
if first is not None:
    first.wait()
fabric.barrier()
if fabric.global_rank == 0:
    Path("ready").write_text("1")
for step in range(2, 10_000):
    save(step)
