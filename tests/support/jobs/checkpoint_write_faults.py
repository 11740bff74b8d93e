"""Checkpoint writes that fail part-way on one rank.

Run by tests/checkpoint/test_checkpoint_layer.py: test_a_failure_on_one_rank_reaches_every_rank_with_its_cause.
"""

import math
from typing import Any, cast

import torch
from job_runner import report

import phalanx
from phalanx.strategies import FSDPStrategy
from phalanx.utils.errors import CheckpointError

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="fsdp")
fabric.launch()
r = fabric.global_rank
model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))

class FailsOnRankZero:
    def state_dict(self) -> Any:
        if r == 0:
            raise ValueError("cannot serialize the sampler")
        return {}
    def load_state_dict(self, state: Any) -> None:
        pass

out: dict[str, Any] = {}
for form in ("sharded", "full"):
    cast(FSDPStrategy, fabric.strategy).state_dict_type = form
    path = "good" if form == "sharded" else "good.pt"
    fabric.save(path, {"model": model, "step": 1})
    try:
        fabric.save(path, {"model": model, "step": 2, "sampler": FailsOnRankZero()})
        out[form] = None
    except CheckpointError as err:
        out[form] = str(err)
    state = {"model": model, "step": -1}
    fabric.load(path, state)
    out[form + ":step"] = state["step"]
    fabric.remove_checkpoint(path)

# Non-finite weights in one rank's shard only: every rank must see it.
out["finite"] = fabric.strategy.weights_finite(model)
if r == 1:
    with torch.no_grad():
        next(model.parameters()).to_local()[0, 0] = math.nan
out["nan_on_rank1"] = fabric.strategy.weights_finite(model)
report(fabric, **out)
