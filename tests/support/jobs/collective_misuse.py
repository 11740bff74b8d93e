"""Collectives misused on 2 ranks, one scenario per run (argv[1]); run by tests/distributed/test_lockstep.py.

Each rank reports the error its attempt raised (or None), the message and the seconds it took.
"""

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from job_runner import report

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2)
fabric.launch()
model = fabric.setup(torch.nn.Linear(3, 1))
r = fabric.global_rank


def attempt(fn: Any) -> None:
    start = time.monotonic()
    try:
        fn()
    except Exception as err:
        report(fabric, error=type(err).__name__, message=str(err), seconds=time.monotonic() - start)
        raise
    report(fabric, error=None, seconds=time.monotonic() - start)


SCENARIO = sys.argv[1]
if SCENARIO == "save_vs_barrier":
    attempt(lambda: fabric.save("a.ckpt", {"model": model}) if r == 0 else fabric.barrier())

elif SCENARIO == "barrier_vs_exit":
    if r == 0:
        attempt(lambda: fabric.barrier("sync after eval"))

elif SCENARIO == "save_vs_training":
    def step() -> None:
        fabric.backward(model(torch.randn(4, 3)).sum())
    step()
    attempt(lambda: fabric.save("a.ckpt", {"model": model}) if r == 0 else step())

elif SCENARIO == "raw_barrier":
    attempt(lambda: fabric.all_reduce(torch.ones(2)) if r == 0 else dist.barrier())

elif SCENARIO == "slow_rank":
    def slow_then_barrier() -> None:
        if r == 1:
            time.sleep(1.5 * float(os.environ["PHALANX_GUARD_TIMEOUT"]))  # past the guard bound: alive, on its way
        fabric.barrier("after slow work")
    attempt(slow_then_barrier)
    attempt(lambda: fabric.save("a.ckpt", {"model": model}))

elif SCENARIO == "shapes":
    attempt(lambda: fabric.all_reduce(torch.ones(2 + r)))

elif SCENARIO == "call_sites":
    def branchy() -> None:
        if r == 0:
            fabric.barrier()
        else:
            fabric.barrier()
    attempt(branchy)
