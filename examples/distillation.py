"""Distillation: a frozen teacher and a trainable student in one plain ``nn.ModuleDict``, with the
student and teacher called directly (``model.student(x)``), under DDP (default) or FSDP.

Under DDP, plain torch would leave the student's gradients unsynchronized (its forward bypasses DDP's
reducer); phalanx averages them and, with ``verify_sync=True``, checks it after every backward.
Under FSDP, ``fully_shard`` refuses a container without ``forward``; phalanx shards the teacher and
the student as their own units (the container holds no parameters), so calling them directly is
exactly what FSDP expects. Both strategies train the same student: compare the printed checksums.

    python examples/distillation.py                  # 2 processes, DDP
    python examples/distillation.py --strategy fsdp  # 2 processes, FSDP (or PHALANX_STRATEGY=fsdp)
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import phalanx
from phalanx.strategies import DDPStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default=os.environ.get("PHALANX_STRATEGY", "ddp"))
    args = parser.parse_args()
    # verify_sync=True: after every backward, compare gradients across ranks (a debugging aid for DDP;
    # under FSDP every rank holds different shards by design).
    strategy = DDPStrategy(verify_sync=True) if args.strategy == "ddp" else "fsdp"
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)

    model = nn.ModuleDict({
        "teacher": nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
        "student": nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10)),
    })
    model["teacher"].requires_grad_(False)
    optimizer = torch.optim.Adam(model["student"].parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)

    generator = torch.Generator().manual_seed(fabric.global_rank)  # each rank its own data
    for step in range(20):
        x = torch.randn(64, 32, generator=generator)
        with torch.no_grad():
            soft_targets = model.teacher(x).softmax(-1)
        log_probs = model.student(x).log_softmax(-1)
        loss = nn.functional.kl_div(log_probs, soft_targets, reduction="batchmean")
        optimizer.zero_grad()
        fabric.backward(loss)  # grads averaged (DDP) or reduce-scattered (FSDP) across ranks
        optimizer.step()
        if step % 5 == 0:
            fabric.print(f"step {step:2d}  kl {float(fabric.all_reduce(loss.detach())):.4f}")
    fabric.verify_in_sync(model)  # parameters too: identical on every rank (the replicated ones)
    # Sharded parameters are DTensors: full_tensor() gathers them (a collective: every rank calls it).
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.student.parameters()]
    checksum = sum(float(p.detach().double().abs().sum()) for p in full)
    fabric.print(f"student checksum {checksum:.6f} ({args.strategy})")
    fabric.print("student replicas identical on all ranks" if args.strategy == "ddp" else "student trained (fsdp)")


if __name__ == "__main__":
    main()
