"""Saves an FSDP model and optimizer, sharded and full, in the precision in argv[1].

Run by tests/strategies/test_fsdp_checkpoint.py: saved, test_sixteen_mixed_scaler_state_round_trips.
"""

import sys
from typing import Any, cast

import torch
from fsdp_models import full, full_params, make_data, make_model
from job_runner import report

import phalanx
from phalanx.precision import MixedPrecision
from phalanx.strategies import FSDPStrategy

PRECISION = sys.argv[1]
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(), precision=PRECISION)
fabric.launch()
x, y = make_data()
r = fabric.global_rank
ce = torch.nn.functional.cross_entropy

class Counter:  # a user object with state_dict/load_state_dict
    def __init__(self) -> None:
        self.n = 0
    def state_dict(self) -> Any:
        return {"n": self.n}
    def load_state_dict(self, sd: Any) -> None:
        self.n = sd["n"]

def build() -> Any:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched

def train(model: Any, opt: Any, sched: Any, counter: Any, steps: int) -> None:
    for i in range(0, 8 * steps, 8):
        opt.zero_grad()
        fabric.backward(ce(model(x[i + 4 * r : i + 4 * r + 4]), y[i + 4 * r : i + 4 * r + 4]))
        opt.step()
        sched.step()
        counter.n += 1

def opt_state(model: Any, opt: Any) -> Any:
    # Every tensor of the optimizer state, unsharded, in parameter order.
    st = opt.state
    return torch.cat([full(st[p][k]) for p in model.parameters() for k in ("exp_avg", "exp_avg_sq", "step")])

model, opt, sched = build()
counter = Counter()
train(model, opt, sched, counter, 2)
state = {"model": model, "optimizer": opt, "scheduler": sched, "counter": counter, "step": 2, "note": "hi"}
cast(FSDPStrategy, fabric.strategy).state_dict_type = "sharded"
fabric.save("ckpt", state)
cast(FSDPStrategy, fabric.strategy).state_dict_type = "full"
fabric.save("ckpt.pt", state)
report(fabric, params=full_params(model), opt=opt_state(model, opt), lr=sched.get_last_lr())
train(model, opt, sched, counter, 1)
report(fabric, after=full_params(model))

for name in ("ckpt", "ckpt.pt"):
    model, opt, sched = build()
    counter = Counter()
    fresh = {"model": model, "optimizer": opt, "scheduler": sched, "counter": counter, "step": 0}
    rest = fabric.load(name, fresh)
    report(fabric, **{
        name + ":params": full_params(model), name + ":opt": opt_state(model, opt),
        name + ":lr": sched.get_last_lr(), name + ":counter": counter.n, name + ":step": fresh["step"],
        name + ":rest": sorted(rest), name + ":note": rest.get("note"),
    })
    train(model, opt, sched, counter, 1)  # continuing must match the run that never stopped
    report(fabric, **{name + ":after": full_params(model)})
    everything = fabric.load(name)  # no state: every entry as plain full tensors, read by each rank itself
    whole = torch.cat([v.reshape(-1).double() for v in everything["model"].values()])
    report(fabric, **{name + ":whole": whole, name + ":whole_keys": sorted(everything),
                      name + ":whole_opt": sorted(everything["optimizer"]["state"])})
if PRECISION == "16-mixed":
    scaler = cast(MixedPrecision, fabric.strategy.precision).scaler
    assert scaler is not None
    report(fabric, scale=scaler.get_scale())
