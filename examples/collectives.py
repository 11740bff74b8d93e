"""Collectives, and what happens when only some ranks call one.

    python examples/collectives.py            # reductions across 2 ranks
    python examples/collectives.py --mistake  # rank 0 alone saves: a named error in seconds, not a hang
"""

from __future__ import annotations

import argparse

import torch

import phalanx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mistake", action="store_true")
    args = parser.parse_args()

    fabric = phalanx.Fabric(accelerator="cpu", devices=2)
    fabric.launch()
    value = torch.tensor(float(fabric.global_rank + 1))
    # all_reduce writes its result into the tensor it is given (as in Lightning); reduce copies to keep `value`.
    fabric.print("sum  ", fabric.all_reduce(value.clone(), reduce_op="sum").item())
    fabric.print("mean ", fabric.all_reduce(value.clone()).item())
    fabric.print("gather", fabric.all_gather(value).tolist())
    fabric.print("broadcast from rank 1:", fabric.broadcast(f"hello from rank {fabric.global_rank}", src=1))
    with fabric.rank_zero_first():
        print(f"rank {fabric.global_rank} in rank_zero_first (rank 0 ran first)", flush=True)

    if args.mistake:
        model = fabric.setup(torch.nn.Linear(2, 2))
        if fabric.global_rank == 0:  # the classic bug: save is a collective, every rank must call it
            fabric.save("runs/collectives.ckpt", {"model": model})
        fabric.barrier()


if __name__ == "__main__":
    main()
