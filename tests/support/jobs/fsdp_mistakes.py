"""Sharded (FSDP) mistakes on 2 ranks, one per run (argv[1]); each rank reports the error of its attempt (``none``)
and its message (run by tests/fabric/test_bad_input.py).

* ``save_then_load_wider``: save a model, then load it into a wider one;
* ``load``: load the checkpoint ``sharded`` (the test damaged one of its files);
* ``optimizer_before_setup``: an optimizer built over the parameters before ``fabric.setup``.
"""

import sys
from typing import Any

import torch
from job_runner import report

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="fsdp")
fabric.launch()


def attempt(fn: Any) -> None:
    try:
        fn()
        report(fabric, error="none", message="")
    except Exception as err:
        report(fabric, error=type(err).__name__, message=str(err))


MISTAKE = sys.argv[1]
if MISTAKE == "save_then_load_wider":
    model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    fabric.save("sharded", {"model": model})
    wider = fabric.setup(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    attempt(lambda: fabric.load("sharded", {"model": wider}))
elif MISTAKE == "load":
    model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    attempt(lambda: fabric.load("sharded", {"model": model}))
elif MISTAKE == "optimizer_before_setup":
    raw = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    model = fabric.setup(raw)
    attempt(lambda: fabric.setup_optimizers(opt))
