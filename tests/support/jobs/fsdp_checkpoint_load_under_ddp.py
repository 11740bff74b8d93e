"""Loads the FSDP checkpoints in the folder argv[1] under DDP.

Run by tests/strategies/test_fsdp_checkpoint.py: test_ddp_loads_an_fsdp_sharded_checkpoint.
"""

import sys

import torch
from fsdp_models import full_params, make_model
from job_runner import report

import phalanx

SAVED = sys.argv[1]  # the folder the saving job wrote
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
for name in (f"{SAVED}/ckpt", f"{SAVED}/ckpt.pt"):
    model = make_model()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(name, state, strict=False)
    exp = torch.cat([torch.cat([opt.state[p][k].reshape(-1).double() for k in ("exp_avg", "exp_avg_sq", "step")])
                     for p in model.parameters()])
    report(fabric, **{name.split("/")[-1]: full_params(model), name.split("/")[-1] + ":opt": exp,
                      name.split("/")[-1] + ":step": state["step"]})
