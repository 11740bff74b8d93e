"""Gradient clipping under FSDP.

Run by tests/strategies/test_fsdp.py: test_clipping_by_any_norm_and_by_value_equals_single_process.
"""

from typing import Any

import torch
from fsdp_models import Block, Distill, Net, Teacher, full_grads, full_params, make_data, make_model
from job_runner import report

import phalanx
import phalanx.strategies.fsdp.guards as fsdp_guards
from phalanx.strategies import FSDPStrategy
from phalanx.utils.errors import MisconfigurationError

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Net, Block, Teacher}))
fabric.launch()
x, y = make_data()
r = fabric.global_rank
model = fabric.setup_module(make_model())
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
norms = []
utils, get_total_norm = torch.nn.utils, torch.nn.utils.get_total_norm
clips: tuple[dict[str, Any], ...] = ({"max_norm": 0.05, "norm_type": float("inf")}, {"clip_val": 0.01},
                                     {"max_norm": 0.1, "norm_type": 1.0}, {"max_norm": 0.05})
for i, clip in zip(range(0, 32, 8), clips):
    opt.zero_grad()
    lo = i + 4 * r
    fabric.backward(torch.nn.functional.cross_entropy(model(x[lo : lo + 4]), y[lo : lo + 4]))
    if i == 24:  # as on torch < 2.6: clip_grad_norm_ on the DTensor gradients
        del utils.get_total_norm
    try:
        norm = fabric.clip_gradients(model, opt, **clip)
    finally:
        utils.get_total_norm = get_total_norm
    norms.append(None if norm is None else float(norm))
    opt.step()
report(fabric, params=full_params(model), norms=norms)

opt.zero_grad()
fabric.backward(model(x[:4]).sum() * float("nan"))
try:
    fabric.clip_gradients(model, opt, max_norm=1.0)
    report(fabric, nonfinite_error=None)
except RuntimeError as err:
    report(fabric, nonfinite_error=str(err))

# A torch without FSDP's private hook to pick the root at setup: the first forward must be the root's.
fsdp_guards.decide_root_now = lambda module: False
distill = fabric.setup_module(make_model(Distill))
xb = x[r * 8 : (r + 1) * 8]
try:
    distill.student(xb)
    report(fabric, early_error=None)
except MisconfigurationError as err:
    report(fabric, early_error=str(err))
with torch.no_grad():
    distill(xb)
fabric.backward(((distill.student(xb) - distill.teacher(xb)) ** 2).mean())
report(fabric, student_grads=full_grads(distill.student))
