"""A Fabric loop run as one replica group of a fault-tolerant job (``phalanx run --replica-groups N``): an MLP on a
fixed synthetic regression set, ``--steps`` optimizer steps, the loop written over the counters in ``state`` (they
jump when the group heals). Each rank appends one JSON line per committed step to ``$PHALANX_TEST_OUT/trace-g<group>
-r<rank>.jsonl`` (pid, step, loss, participants) and, at the end, its weights' CRC to ``final-g<group>-r<rank>.json``.

Arguments: --steps N, --strategy single|ddp|fsdp, --accumulate K, --sleep S (seconds per step: leaves time to kill a
process at a chosen step), --kill-at STEP (this group's rank 0 kills itself once, on its first attempt, with
SIGKILL at that step), --kill-group G (the group that does: default 1)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import zlib
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx as L


def crc(model: nn.Module) -> int:
    value = 0
    for tensor in model.state_dict().values():
        value = zlib.crc32(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes(), value)
    return value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-group", type=int, default=1)
    args = parser.parse_args()
    out = Path(os.environ["PHALANX_TEST_OUT"])
    torch.manual_seed(int(os.environ.get("REPLICA_GROUP_ID", "0")))  # groups seed differently: init_sync unifies
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy=args.strategy)
    fabric.launch()
    data = torch.Generator().manual_seed(0)
    x = torch.randn(1536, 16, generator=data)
    y = x @ torch.randn(16, 1, generator=data) + 0.1 * torch.randn(1536, 1, generator=data)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0}
    fabric.join_replica_groups(state)
    groups = fabric.replica_groups
    group = groups.env.group if groups is not None else 0
    rank = fabric.global_rank
    trace = (out / f"trace-g{group}-r{rank}.jsonl").open("a")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    while state["step"] < args.steps:
        for batch in loader:
            if state["step"] >= args.steps:
                break
            if state["step"] == args.kill_at and attempt == 0 and rank == 0 and group == args.kill_group:
                os.kill(os.getpid(), signal.SIGKILL)
            x_, y_ = batch
            optimizer.zero_grad()
            for micro in range(args.accumulate):
                chunk = slice(micro * len(x_) // args.accumulate, (micro + 1) * len(x_) // args.accumulate)
                with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                    loss = nn.functional.mse_loss(model(x_[chunk]), y_[chunk])
                    fabric.backward(loss / args.accumulate)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            scheduler.step()
            state["step"] += 1
            trace.write(json.dumps({"pid": os.getpid(), "attempt": attempt, "step": state["step"],
                                    "loss": float(loss.detach()), "time": time.time()}) + "\n")
            trace.flush()
            if args.sleep:
                time.sleep(args.sleep)
    (out / f"final-g{group}-r{rank}.json").write_text(json.dumps(
        {"crc": crc(model), "step": state["step"], "pid": os.getpid(),
         "tally": groups.tally.state_dict() if groups is not None else None}))


if __name__ == "__main__":
    main()
