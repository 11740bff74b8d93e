"""The job of tests/strategies/test_ddp.py::test_launch_function_returns_rank_zero_result."""

import torch

import phalanx


def work(fabric, base):
    return float(fabric.all_reduce(torch.tensor(base + fabric.global_rank), reduce_op="sum"))

if __name__ == "__main__":
    fabric = phalanx.Fabric(accelerator="cpu", devices=2)
    print("result", fabric.launch(work, 10.0))
