"""FSDP on 2 ranks through ``fabric.launch(main)``: after training, rank 0 alone runs a forward ("generate a sample
on rank 0"), while rank 1 returns, or (argv[1] ``True``) waits in a barrier (run by
tests/distributed/test_watchdog.py)."""

import sys
import time
from typing import Any

import torch
from job_runner import report

import phalanx

RANK1_BARRIER = sys.argv[1] == "True"


def main(fabric: phalanx.Fabric) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    for _ in range(2):
        fabric.backward(model(torch.randn(4, 16)).sum())
        opt.step()
        opt.zero_grad()
    if fabric.global_rank == 0:
        with torch.no_grad():
            model(torch.randn(1, 16))   # "generate a sample on rank 0": FSDP all-gathers the parameters
    elif RANK1_BARRIER:
        start = time.monotonic()
        try:
            fabric.barrier("after sampling")
        except Exception as err:
            report(fabric, error=type(err).__name__, message=str(err), seconds=time.monotonic() - start)
            raise
    return "done"


if __name__ == "__main__":
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="fsdp")
    start = time.monotonic()
    try:
        fabric.launch(main)
    except Exception as err:
        report(rank=0, launcher_error=type(err).__name__, message=str(err), seconds=time.monotonic() - start)
