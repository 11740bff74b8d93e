"""FSDP training in the precision in argv[1].

Run by tests/strategies/test_fsdp.py: test_empty_init_and_mixed_precision.
"""

import sys
from typing import Any, cast

import torch
from fsdp_models import Net, full_params, make_data
from job_runner import report
from torch import nn

import phalanx
from phalanx.precision import MixedPrecision
from phalanx.utils.errors import MisconfigurationError

PRECISION = sys.argv[1]
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="fsdp", precision=PRECISION)
fabric.launch()
x, y = make_data()
r = fabric.global_rank

# empty_init: parameters on the meta device, only local shards materialized at setup.
torch.manual_seed(0)
with fabric.init_module(empty_init=True):
    model: Any = Net()
report(fabric, meta_before=all(p.is_meta for p in model.parameters()))
model = fabric.setup_module(model)
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
w = model.blocks[0].l1.weight  # (16, 8): 8 rows per rank
report(fabric, meta_after=any(p.is_meta or p.to_local().is_meta for p in model.parameters()),
       local_shape=list(w.to_local().shape), local_sum=float(w.to_local().sum()),
       param_dtype=str(w.dtype), init_std=float(w.full_tensor().std()))
dtypes = []
model.blocks[0].l1.register_forward_hook(lambda m, a, out: dtypes.append(str(a[0].dtype)))
def full_data_loss() -> Any:
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))

losses = [full_data_loss()]
for _ in range(3):  # three epochs over the 32 samples, 8 per step (4 per rank)
    for i in range(0, 32, 8):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[i + 4 * r : i + 4 * r + 4]), y[i + 4 * r : i + 4 * r + 4])
        fabric.backward(loss)
        opt.step()
    losses.append(full_data_loss())
report(fabric, losses=losses, compute_dtype=dtypes[0], grad_dtype=str(w.grad.dtype))

class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

try:
    with fabric.init_module(empty_init=True):
        bad = nn.Sequential(nn.Linear(4, 4), NoReset())
    fabric.setup_module(bad)
    report(fabric, no_reset_error=None)
except MisconfigurationError as err:
    report(fabric, no_reset_error=str(err))

if PRECISION == "16-mixed":
    # An overflow on one rank only must skip the step on every rank (shards would diverge otherwise).
    before = full_params(model)
    scaler = cast(MixedPrecision, fabric.strategy.precision).scaler
    assert scaler is not None
    scale = scaler.get_scale()
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x[:4]), y[:4])
    fabric.backward(loss * (float("inf") if r == 1 else 1.0))
    opt.step()
    report(fabric, skipped=bool(torch.equal(before, full_params(model))),
           scale_ratio=scaler.get_scale() / scale)
