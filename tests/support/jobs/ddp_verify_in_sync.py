"""verify_in_sync names the parameter that rank 1 changed (run by tests/strategies/test_ddp.py)."""

import torch
from ddp_models import make_model
from job_runner import report

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2)
fabric.launch()
model = fabric.setup(make_model())
fabric.verify_in_sync(model, grads=False)  # identical after setup (DDP broadcast rank 0's)
if fabric.global_rank == 1:
    with torch.no_grad():
        model.module[2].bias.add_(1e-3)
try:
    fabric.verify_in_sync(model, grads=False)
except phalanx.errors.GradientSyncError as err:
    report(fabric, error=str(err))
