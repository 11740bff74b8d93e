"""Saves model and optimizer every step until killed, under FSDP (argv[1] ``fsdp``) or FSDP with asynchronous saves
(``fsdp_async``); rank 0 writes ``ready`` once the first save is in place (run by tests/support/killed_saves.py)."""

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import phalanx
from phalanx.strategies import FSDPStrategy

torch.set_num_threads(1)
STRATEGY = {"fsdp": "fsdp", "fsdp_async": FSDPStrategy(async_save=True)}[sys.argv[1]]
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=STRATEGY)
fabric.launch()
Path(f"pid{fabric.global_rank}").write_text(str(os.getpid()))
model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters()))
model(torch.randn(2, 512)).sum().backward()
opt.step()

def fill(step: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))

def save(step: int) -> Any:
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
