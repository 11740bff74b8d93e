"""ZeRO with DeepSpeed in a hand-written loop, on 2 CPU processes (gloo) or GPUs.

    python examples/deepspeed_zero.py --stage 3 --accumulate 4

The loop is the same one that runs on DDP: accumulation through no_backward_sync and one
optimizer.step() per window. It saves a sharded checkpoint (a directory, resumable at the same world
size) and a consolidated file that plain PyTorch can load.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import phalanx
from phalanx.strategies import DeepSpeedStrategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    fabric = phalanx.Fabric(accelerator="auto", devices=2, strategy=DeepSpeedStrategy(stage=args.stage))
    fabric.launch()
    fabric.seed_everything(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)

    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    for step in range(args.steps):
        for micro in range(args.accumulate):
            x = torch.randn(8, 16, device=fabric.device)
            boundary = micro == args.accumulate - 1
            # Sync (DeepSpeed's accumulation boundary) only on the window's last micro-batch.
            with fabric.no_backward_sync(model, enabled=not boundary):
                loss = nn.functional.mse_loss(model(x), x @ target.to(fabric.device))
                fabric.backward(loss / args.accumulate)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            fabric.print(f"step {step}: loss {loss.item():.4f}")

    state = {"model": model, "optimizer": optimizer, "step": args.steps}
    fabric.save("zero_checkpoint", state)  # sharded: one directory, every rank writes its partition
    fabric.strategy.state_dict_type = "full"  # type: ignore[attr-defined]
    fabric.save("zero_full.pt", state)  # one file of float32 weights + optimizer state, torch's layout
    fabric.print("saved zero_checkpoint/ and zero_full.pt")


if __name__ == "__main__":
    main()
