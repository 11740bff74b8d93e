"""fabric.launch(work, 10.0) prints rank 0's result (run by tests/strategies/test_ddp.py)."""

from typing import Any

import torch

import phalanx


def work(fabric: phalanx.Fabric, base: Any) -> Any:
    return float(fabric.all_reduce(torch.tensor(base + fabric.global_rank), reduce_op="sum"))

if __name__ == "__main__":
    fabric = phalanx.Fabric(accelerator="cpu", devices=2)
    print("result", fabric.launch(work, 10.0))
