"""An FSDP model that is a container of modules.

Run by tests/strategies/test_fsdp_container.py: test_module_dict_distillation_under_fsdp_equals_one_process.
"""

from typing import Any

import torch
from fsdp_container_models import loss_of, make_data, make_model
from job_runner import report

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="fsdp")
fabric.launch()
model = make_model()
model, opt = fabric.setup(model, torch.optim.Adam(model["student"].parameters(), lr=0.01))
x = make_data()
r = fabric.global_rank
for step in range(3):  # windows of 2 micro-batches of 4 samples per rank
    for micro in range(2):
        start = step * 16 + micro * 8 + 4 * r
        with fabric.no_backward_sync(model, enabled=micro == 0):
            fabric.backward(loss_of(model, x[start : start + 4]) / 2)
    opt.step()
    opt.zero_grad()
def full(m: Any) -> Any:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).double()
                      for p in m.parameters()])


fabric.save("ckpt", {"model": model, "optimizer": opt})
student, teacher = full(model.student), full(model.teacher)
with torch.no_grad():
    for p in model.student.parameters():
        p.zero_()
fabric.load("ckpt", {"model": model, "optimizer": opt})
report(fabric, student=student, teacher=teacher, reloaded=full(model.student),
       sharded=[type(p).__name__ for p in model.student.parameters()])
