"""Distillation under DDP with verify_sync.

Run by tests/strategies/test_ddp.py: test_distillation_call_paths_sync_gradients.
"""

from collections.abc import Callable
from typing import Any

import torch
from ddp_models import Distill, make_data
from job_runner import report

import phalanx
from phalanx.strategies import DDPStrategy

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(verify_sync=True))
fabric.launch()
model: Any = Distill()
opt = torch.optim.SGD(model["student"].parameters(), lr=0.1)
stale_student = model["student"]  # a reference kept from before setup
model, opt = fabric.setup(model, opt)
x, _ = make_data()
xb = x[fabric.global_rank * 8 : (fabric.global_rank + 1) * 8]

def mse(a: Any, b: Any) -> Any:
    return ((a - b) ** 2).mean()

paths: dict[str, Callable[[], torch.Tensor]] = {
    "attribute": lambda: mse(model.student(xb), model.teacher(xb).detach()),
    "item": lambda: mse(model["student"](xb), model["teacher"](xb).detach()),
    "teacher_with_grad": lambda: mse(model.student(xb), model.teacher(xb)),
    "custom_method": lambda: model.distill(xb),
    "stale_reference": lambda: mse(stale_student(xb), model.teacher(xb).detach()),
}
grads = {}
for name, loss_fn in paths.items():
    opt.zero_grad()
    fabric.backward(loss_fn())
    grads[name] = torch.cat([p.grad.reshape(-1) for p in model.student.parameters()])
    assert all(p.grad is None for p in model.teacher.parameters()), "frozen params must get no grad"
report(fabric, grads=grads)
