"""One rank raises inside save.

Run by tests/distributed/test_watchdog.py: test_ordinary_exception_on_rank_zero_inside_save_names_it_on_rank_one.
"""

import time
from typing import Any

import torch
from job_runner import report

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2)
fabric.launch()
model = fabric.setup(torch.nn.Linear(3, 1))
fabric.save("ok.ckpt", {"model": model})

class Stats:
    def state_dict(self) -> Any:
        if fabric.global_rank == 0:
            raise ValueError("the stats table is locked")
        return {}

    def load_state_dict(self, state: Any) -> None:
        pass

start = time.monotonic()
try:
    fabric.save("next.ckpt", {"model": model, "stats": Stats()})
except Exception as err:
    report(fabric, error=type(err).__name__, message=str(err), seconds=time.monotonic() - start)
    raise
