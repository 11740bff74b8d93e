"""DDP accumulation over 2 micro-batches with no_backward_sync; a step on local-only gradients is refused.

Run by tests/strategies/test_ddp.py.
"""

import torch
from ddp_models import make_data, make_model
from job_runner import flat_params, report

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2)
fabric.launch()
model = fabric.setup(make_model())
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
x, y = make_data()
r = fabric.global_rank
for step in range(2):            # 2 optimizer steps of 2 micro-batches of 4 per rank
    for micro in range(2):
        lo = step * 16 + micro * 8 + r * 4
        with fabric.no_backward_sync(model, enabled=micro == 0):
            loss = torch.nn.functional.cross_entropy(model(x[lo:lo + 4]), y[lo:lo + 4]) / 2
            fabric.backward(loss)
    opt.step()
    opt.zero_grad()
report(fabric, params=flat_params(model))
# Stepping on local-only gradients would make the replicas diverge: refused.
with fabric.no_backward_sync(model):
    fabric.backward(model(x[:4]).sum())
try:
    opt.step()
except phalanx.errors.GradientSyncError as err:
    report(fabric, error=str(err))
