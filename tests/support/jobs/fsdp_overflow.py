"""A 16-mixed overflow in one shard, on fsdp or on hybrid sharding (argv[1]).

Run by tests/strategies/test_fsdp.py: test_sixteen_mixed_overflow_in_one_shard_skips_every_rank.
"""

import sys
from typing import Any, cast

import torch
from fsdp_models import full_params, make_data, make_model
from job_runner import report

import phalanx
from phalanx.precision import MixedPrecision
from phalanx.strategies import FSDPStrategy

# argv[1] names the strategy: "fsdp", or "hybrid" (hybrid sharding's 2-D mesh (replicate, shard) = (1, 2))
STRATEGY = {"fsdp": "fsdp", "hybrid": FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(1, 2))}[sys.argv[1]]
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=STRATEGY, precision="16-mixed")
fabric.launch()
x, y = make_data()
r = fabric.global_rank
model = fabric.setup_module(make_model())
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
precision = cast(MixedPrecision, fabric.strategy.precision)
assert precision.scaler is not None
scaler = precision.scaler

def step(poison: Any, clip: Any) -> Any:
    before, scale = full_params(model), scaler.get_scale()
    opt.zero_grad()
    fabric.backward(torch.nn.functional.cross_entropy(model(x[:4]), y[:4]))
    grad = model.head.weight.grad.to_local()  # rows 0-1 on rank 0, row 2 on rank 1
    if poison and r == 1:
        # After the reduce-scatter: the overflow exists in rank 1's shard only.
        grad[0, 0] = float("inf")
    local_finite = bool(torch.isfinite(grad).all())
    if clip:
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
    opt.step()
    return {"local_finite": local_finite, "skipped": bool(torch.equal(before, full_params(model))),
            "scale_ratio": scaler.get_scale() / scale}

report(fabric, poisoned=step(True, clip=False), clean=step(False, clip=False),
       poisoned_clipped=step(True, clip=True), clean_clipped=step(False, clip=True))
