"""FSDP training with the FSDPStrategy options given as JSON in argv[1].

Run by tests/strategies/test_fsdp.py: test_fsdp_training_equals_single_process.
"""

import json
import sys

import torch
from fsdp_models import Block, full_params, make_data, make_model
from job_runner import report

import phalanx
from phalanx.strategies import FSDPStrategy
from phalanx.utils.errors import GradientSyncError

# argv[1]: FSDPStrategy's keyword arguments as JSON, a policy as a list of class names ("Block")
KWARGS = {key: {Block} if value == ["Block"] else value for key, value in json.loads(sys.argv[1]).items()}
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(**KWARGS))
fabric.launch()
x, y = make_data()
r = fabric.global_rank
ce = torch.nn.functional.cross_entropy

# A: optimizer built before setup -> phalanx re-points it at the sharded parameters.
model2 = make_model()
model, opt = fabric.setup(model2, torch.optim.Adam(model2.parameters(), lr=0.01))
assert all(type(p).__name__ == "DTensor" for g in opt.param_groups for p in g["params"])
norms = []
for i in range(0, 32, 8):
    opt.zero_grad()
    fabric.backward(ce(model(x[i + 4 * r : i + 4 * r + 4]), y[i + 4 * r : i + 4 * r + 4]))
    norm = fabric.clip_gradients(model, opt, max_norm=0.5)
    assert norm is not None
    norms.append(norm.item())
    opt.step()
report(fabric, a=full_params(model), a_norms=norms)

# B: gradient accumulation (2 micro-batches per step) through setup_module + setup_optimizers.
model = fabric.setup_module(make_model())
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
sharded_grad_none_inside_no_sync = []
for i in range(0, 32, 8):
    opt.zero_grad()
    for j, micro in enumerate((0, 2)):
        lo = i + 4 * r + micro
        with fabric.no_backward_sync(model, enabled=j == 0):
            fabric.backward(ce(model(x[lo : lo + 2]), y[lo : lo + 2]) / 2)
        if j == 0:
            # The reduce-scatter was skipped: no sharded gradient exists yet.
            sharded_grad_none_inside_no_sync.append(all(p.grad is None for p in model.parameters()))
    opt.step()
report(fabric, b=full_params(model), skipped=sharded_grad_none_inside_no_sync)

# Stepping after an unsynchronized backward must raise, like DDP.
with fabric.no_backward_sync(model):
    fabric.backward(ce(model(x[:4]), y[:4]))
try:
    opt.step()
    report(fabric, step_error=None)
except GradientSyncError as err:
    report(fabric, step_error=str(err))
