"""clip_gradients and init_module under 64-true DDP (run by tests/strategies/test_ddp.py)."""

import torch
from ddp_models import make_data, make_model
from job_runner import report

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2, precision="64-true")
fabric.launch()
with fabric.init_module():
    created = torch.nn.Linear(2, 2)
model = fabric.setup(make_model())
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
x, y = make_data()
r = fabric.global_rank
fabric.backward(torch.nn.functional.cross_entropy(model(x[r * 8:(r + 1) * 8]), y[r * 8:(r + 1) * 8]))
norm = fabric.clip_gradients(model, opt, max_norm=0.01)
clipped = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
report(fabric, norm=norm, clipped=clipped, created_dtype=str(created.weight.dtype))
