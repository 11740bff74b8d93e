"""DeepSpeed misuse, each refused.

Run by tests/strategies/test_deepspeed.py: test_misuse_raises_like_ddp_and_clipping_maps_to_deepspeed.
"""

from typing import Any, cast

import torch
from deepspeed_mlp import CountingSGD, W, batches, make_model
from job_runner import report
from torch import nn

import phalanx
from phalanx.strategies import DeepSpeedStrategy
from phalanx.utils.errors import GradientSyncError, MisconfigurationError

fabric = phalanx.Fabric(accelerator="cpu", devices=W, strategy=DeepSpeedStrategy(stage=2))
fabric.launch()
model = make_model()
model, opt = fabric.setup(model, CountingSGD(model.parameters(), lr=0.1))
X, Y = batches(1)
errors: dict[str, Any] = {}
def attempt(name: str, fn: Any) -> None:
    try:
        fn()
    except (GradientSyncError, MisconfigurationError) as err:
        errors[name] = f"{type(err).__name__}: {err}"
with fabric.no_backward_sync(model):
    fabric.backward(nn.functional.mse_loss(model(X[0, 0, 0]), Y[0, 0, 0]))
attempt("step_after_no_sync", opt.step)
attempt("zero_grad_without_step", opt.zero_grad)
attempt("clip_val", lambda: fabric.clip_gradients(model, opt, clip_val=0.1))
attempt("norm_type", lambda: fabric.clip_gradients(model, opt, max_norm=1.0, norm_type=1.0))
second = make_model()
attempt("second_engine", lambda: fabric.setup(second, torch.optim.SGD(second.parameters(), lr=0.1)))
attempt("setup_optimizers", lambda: fabric.setup_optimizers(torch.optim.SGD(make_model().parameters(), lr=0.1)))
# The sync'd micro-batch closes the window; clipping then applies inside DeepSpeed's step.
fabric.backward(nn.functional.mse_loss(model(X[0, 1, 0]), Y[0, 1, 0]))
before = [p.detach().clone() for p in model.module.parameters()]
assert fabric.clip_gradients(model, opt, max_norm=1e-3) is None
opt.step()
opt.zero_grad()
moved = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.module.parameters(), before)])
norm = cast(DeepSpeedStrategy, fabric.strategy).engine.get_global_grad_norm()
report(fabric, errors=errors, calls=CountingSGD.calls, update_norm=float(moved.norm()), grad_norm=float(norm))
