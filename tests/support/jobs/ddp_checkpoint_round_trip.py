"""A 16-mixed DDP model and Adam saved and loaded back into fresh objects (run by tests/strategies/test_ddp.py)."""

import os

import torch
from ddp_models import make_data, make_model
from job_runner import flat_params, report

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2, precision="16-mixed")
fabric.launch()
model = fabric.setup(make_model())
opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
x, y = make_data()
for i in range(3):
    xb, yb = x[i * 4:i * 4 + 4], y[i * 4:i * 4 + 4]
    fabric.backward(torch.nn.functional.cross_entropy(model(xb), yb))
    opt.step()
    opt.zero_grad()
fabric.save("ckpt/a.ckpt", {"model": model, "opt": opt, "step": 3})
files = sorted(os.listdir("ckpt"))
model2 = fabric.setup(make_model())
opt2 = fabric.setup_optimizers(torch.optim.Adam(model2.parameters(), lr=0.01))
state = {"model": model2, "opt": opt2, "step": 0}
fabric.load("ckpt/a.ckpt", state)
same_opt = all(
    torch.equal(a["exp_avg"], b["exp_avg"])
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values())
)
report(fabric, params=flat_params(model), loaded=flat_params(model2), step=state["step"], files=files,
       same_opt=same_opt)
