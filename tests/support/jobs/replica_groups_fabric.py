"""A Fabric loop run as one replica group of a fault-tolerant job (``phalanx run --replica-groups N``): the model and
data of tests/support/replica_models.py, ``--steps`` optimizer steps, the loop written over the counters in ``state``
(they jump when the group heals). Each rank appends one JSON line per step to ``$PHALANX_TEST_OUT/trace-g<group>
-r<rank>.jsonl`` (pid, attempt, step) and, at the end, writes ``final-g<group>-r<rank>.json`` (its weights' CRC, the
loss over the whole data set, the tally of trained and skipped samples).

Arguments: --steps N, --strategy single|ddp|fsdp, --sleep S (seconds per step: leaves time to act at a chosen step),
--kill-at STEP and --kill-group G (that group's rank 0 kills itself with SIGKILL at that step, on its first attempt),
--timeout S (FaultTolerance.timeout), --ckpt DIR (resume from the newest checkpoint there; on a preemption signal save
one and exit with code 75), --ready-at STEP (group 0's rank 0 writes ``ready`` once at that step, and each rank its pid
to ``pid-g<group>-r<rank>``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from replica_models import BATCH, crc, dataset, full_loss, make_model, make_optimizer, started
from torch import nn
from torch.utils.data import DataLoader

import phalanx as L


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-group", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--ready-at", type=int, default=-1)
    args = parser.parse_args()
    out = Path(os.environ["PHALANX_TEST_OUT"])
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    torch.manual_seed(group)  # the groups start from different weights: torchft's init_sync gives them group 0's
    groups_min = int(os.environ.get("PHALANX_MIN_REPLICA_GROUPS", "1"))
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy=args.strategy,
                      fault_tolerance=L.FaultTolerance(min_replica_groups=groups_min, timeout=args.timeout))
    fabric.launch()
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    model = make_model()
    optimizer, _ = make_optimizer(model)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0}
    if args.ckpt is not None:
        found = fabric.latest_checkpoint(args.ckpt)
        if found is not None:
            fabric.load(found, state)
        fabric.stop_requested()  # start listening
    fabric.join_replica_groups(state)
    rank = fabric.global_rank
    (out / f"pid-g{group}-r{rank}").write_text(str(os.getpid()))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    (out / f"start-g{group}-r{rank}-a{attempt}.json").write_text(json.dumps({"time": started()}))
    trace = (out / f"trace-g{group}-r{rank}.jsonl").open("a")
    while state["step"] < args.steps:
        for x, y in loader:
            if state["step"] >= args.steps:
                break
            if state["step"] == args.kill_at and attempt == 0 and rank == 0 and group == args.kill_group:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            fabric.backward(nn.functional.mse_loss(model(x), y))
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            scheduler.step()
            state["step"] += 1
            trace.write(json.dumps({"pid": os.getpid(), "attempt": attempt, "step": state["step"],
                                    "time": time.time()}) + "\n")
            trace.flush()
            if state["step"] == args.ready_at and group == 0 and rank == 0:
                (out / "ready").write_text(str(state["step"]))
            if args.ckpt is not None and fabric.stop_requested():
                path = f"{args.ckpt}/step-{state['step']}.ckpt"
                fabric.save(path, state)
                fabric.exit_preempted(path, step=state["step"])
            if args.sleep:
                time.sleep(args.sleep)
    groups = fabric.replica_groups
    (out / f"final-g{group}-r{rank}.json").write_text(json.dumps({
        "crc": crc(model.module), "loss": full_loss(model.module), "step": state["step"], "pid": os.getpid(),
        "params": [float(v) for p in model.module.parameters() for v in p.detach().reshape(-1)]
        if args.strategy != "fsdp" else None,
        "tally": groups.tally.state_dict() if groups is not None else None,
    }))


if __name__ == "__main__":
    main()
