"""Writes the checkpoints of every strategy that phalanx ckpt inspects and converts.

Run by tests/cli/test_ckpt.py: saved.
"""

import subprocess
import sys
from typing import Any, cast

import torch
from ckpt_command_models import Holder, mlp, tokens
from job_runner import report

import phalanx
from phalanx.strategies import FSDPStrategy

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="fsdp")
fabric.launch()
r = fabric.global_rank

def flat_params(model: Any) -> Any:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).double()
                      for p in model.parameters()])

def build() -> Any:
    model = mlp()
    return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))

def opt_state(model: Any, opt: Any) -> Any:
    st = opt.state
    return torch.cat([(st[p][k].full_tensor() if hasattr(st[p][k], "full_tensor") else st[p][k]).reshape(-1).double()
                      for p in model.parameters() for k in ("exp_avg", "exp_avg_sq", "step")])

model, opt = build()
x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
for _step in range(2):
    opt.zero_grad()
    fabric.backward(model(x[4 * r : 4 * r + 4]).pow(2).mean())
    opt.step()
state = {"model": model, "optimizer": opt, "step": 2, "note": "hi"}
fabric.save("ckpt", state)  # sharded (the default under fsdp)
cast(FSDPStrategy, fabric.strategy).state_dict_type = "full"
fabric.save("ckpt.pt", state)
cast(FSDPStrategy, fabric.strategy).state_dict_type = "sharded"
report(fabric, params=flat_params(model), opt=opt_state(model, opt))

gpt = Holder()
gpt, gopt = fabric.setup(gpt, torch.optim.AdamW(gpt.parameters(), lr=1e-3))
for _step in range(2):
    gopt.zero_grad()
    fabric.backward(gpt(tokens()[2 * r : 2 * r + 2]).pow(2).mean())
    gopt.step()
fabric.save("gpt", {"model": gpt, "optimizer": gopt, "step": 2})
with torch.no_grad():
    report(fabric, logits=gpt(tokens()))

# The converted checkpoints load back under FSDP on 2 ranks (rank 0 converts in a plain process).
if r == 0:
    for src, dst, to in (("ckpt.pt", "from_single", "sharded"), ("ckpt", "from_sharded.pt", "single")):
        subprocess.run([sys.executable, "-m", "phalanx.cli", "ckpt", "convert", src, dst, "--to", to], check=True)
fabric.barrier()
for name in ("from_single", "from_sharded.pt"):
    fresh, fresh_opt = build()
    loaded = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    rest = fabric.load(name, loaded)
    report(fabric, **{name: flat_params(fresh), name + ":opt": opt_state(fresh, fresh_opt),
                      name + ":step": loaded["step"], name + ":rest": rest})
