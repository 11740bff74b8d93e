"""Loads the checkpoints in the folder argv[1] on a dp x tp mesh (argv[2], argv[3]).

Run by tests/strategies/test_model_parallel.py: test_two_by_two_checkpoint_loads_on_other_meshes.
"""

import sys

import torch
from job_runner import report
from model_parallel_models import full_params, make_model, one_more_step, opt_state, parallelize

import phalanx
from phalanx.strategies import ModelParallelStrategy

torch.set_num_threads(1)
SAVED, dp, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fabric = phalanx.Fabric(accelerator="cpu", devices=dp * tp, strategy=ModelParallelStrategy(parallelize, dp, tp))
fabric.launch()
for name in ("ckpt", "ckpt.pt"):
    m = make_model()
    model, opt = fabric.setup(m, torch.optim.Adam(m.parameters(), lr=0.01))
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(f"{SAVED}/{name}", state)
    report(fabric, **{name: full_params(model), name + ":opt": opt_state(model, opt), name + ":step": state["step"]})
    one_more_step(fabric, model, opt)
    report(fabric, **{name + ":after": full_params(model)})
