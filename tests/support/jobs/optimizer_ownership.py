"""Optimizers set up with and without their model, on the strategy in argv[1].

Run by tests/fabric/test_optimizer_ownership.py: test_foreign_parameters_refused_on_two_ranks.
"""

import sys
from collections.abc import Callable

import torch
from job_runner import report
from torch import nn

import phalanx
from phalanx.utils.errors import MisconfigurationError

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=sys.argv[1])
fabric.launch()
torch.manual_seed(0)
model, helper = nn.Linear(4, 4), nn.Linear(4, 1)  # the loss goes through both; only model is set up
errors: list[str | None] = []
build: Callable[[], object]
for build in (
    lambda: fabric.setup(model, torch.optim.SGD([*model.parameters(), *helper.parameters()], lr=0.1)),
    lambda: fabric.setup_optimizers(torch.optim.SGD(helper.parameters(), lr=0.1)),
):
    try:
        build()
        errors.append(None)
    except MisconfigurationError as err:
        errors.append(str(err))
    if errors[-1] is None:
        break
    if len(errors) == 1:
        fabric.setup_module(model)
report(fabric, errors=errors)
