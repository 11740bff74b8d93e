"""Loads the checkpoint at argv[3] on argv[1] ranks with the strategy in argv[2], the way a resumed job would, and
reports its step and whether every weight holds it, or the CheckpointError (run by tests/distributed/test_faults.py).
"""

import sys

import torch
from job_runner import report

import phalanx
from phalanx.utils.errors import CheckpointError

fabric = phalanx.Fabric(accelerator="cpu", devices=int(sys.argv[1]), strategy=sys.argv[2])
fabric.launch()
model = fabric.setup(torch.nn.Linear(1024, 2048))
state = {"model": model, "step": -1}
try:
    fabric.load(sys.argv[3], state)
except CheckpointError as err:
    report(fabric, error=str(err))
    raise SystemExit(0) from None
full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
report(fabric, step=state["step"], consistent=all(bool((p == float(state["step"])).all()) for p in full))
