"""One rank of the DDP throughput benchmark (started by bench/ddp.py through torchrun or `phalanx run`).

Every framework trains the same MLP on the same global batches: each rank reads every other sample
(a DistributedSampler or the framework's own sharding; DDP averages over the union either way), so
the final weights, and the final loss rank 0 prints, must agree across frameworks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    ClockedMLP,
    full_loss,
    make_dataset,
    make_loader,
    make_model,
    make_optimizer,
    step_seconds,
)

CONFIG = {"d_in": 128, "hidden": 384, "depth": 3, "classes": 10}


def raw_torch(data: TensorDataset, batch: int) -> tuple[ClockedMLP, int]:
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = make_model(CONFIG)
    ddp = DistributedDataParallel(model)
    opt = make_optimizer(model)
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=False), drop_last=True)
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return model, rank


def phalanx_fabric(data: TensorDataset, batch: int) -> tuple[ClockedMLP, int]:
    import phalanx

    # The lockstep mode comes from PHALANX_LOCKSTEP (set by bench/ddp.py), exactly as a user sets it.
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    model = make_model(CONFIG)
    wrapped, opt = fabric.setup(model, make_optimizer(model))
    for x, y in fabric.setup_dataloaders(make_loader(data, batch)):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        fabric.backward(loss)
        opt.step()
    rank = fabric.global_rank
    fabric.teardown()
    return model, rank


def lightning_fabric(data: TensorDataset, batch: int) -> tuple[ClockedMLP, int]:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    model = make_model(CONFIG)
    wrapped, opt = fabric.setup(model, make_optimizer(model))
    for x, y in fabric.setup_dataloaders(make_loader(data, batch)):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        fabric.backward(loss)
        opt.step()
    return model, fabric.global_rank


def accelerate_loop(data: TensorDataset, batch: int) -> tuple[ClockedMLP, int]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model(CONFIG)
    wrapped, opt, loader = accelerator.prepare(model, make_optimizer(model), make_loader(data, batch))
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        accelerator.backward(loss)
        opt.step()
    rank = accelerator.process_index
    accelerator.end_training()
    return model, rank


FRAMEWORKS = {
    "raw": raw_torch,
    "phalanx": phalanx_fabric,
    "lightning": lightning_fabric,
    "accelerate": accelerate_loop,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True, help="per-rank batch size")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in ("lightning", "lightning.fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")

    world = int(os.environ["WORLD_SIZE"])
    data = make_dataset(CONFIG, args.steps * args.batch * world)
    model, rank = FRAMEWORKS[args.framework](data, args.batch)
    if len(model.stamps) != args.steps:
        raise RuntimeError(f"{args.framework} ran {len(model.stamps)} steps on rank {rank}, expected {args.steps}.")
    if rank == 0:
        intervals = [b - a for a, b in zip(model.stamps[args.warmup:], model.stamps[args.warmup + 1:])]
        result = {
            "framework": args.framework,
            "mean_step_s": step_seconds(model.stamps, args.warmup),
            "median_step_s": statistics.median(intervals),
            # This rank's CPU time (all threads: gloo's, phalanx's heartbeat) per step.
            "cpu_step_s": step_seconds(model.cpu_stamps, args.warmup),
            "global_batch": args.batch * world,
            "loss": full_loss(model, data),
        }
        print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
