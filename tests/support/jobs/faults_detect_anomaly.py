"""detect_anomaly=True on 2 ranks: a non-finite loss or gradient on one rank stops both at the same backward.

Run by tests/distributed/test_faults.py.
"""

import torch
from job_runner import report

import phalanx
from phalanx.fabric.anomaly import NonFiniteError

fabric = phalanx.Fabric(accelerator="cpu", devices=2, detect_anomaly=True)
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = fabric.setup(model, opt)
r = fabric.global_rank
errors = {}
for step in range(1, 7):
    x = torch.randn(4, 4)
    if step == 4 and r == 0:
        x[0, 0] = float("nan")  # rank 0 only: DDP's all-reduce spreads it to rank 1's gradients
    loss = model(x).pow(2).mean()
    if step == 2 and r == 1:
        loss = loss + float("inf")  # rank 1's loss only; the gradients stay finite
    try:
        fabric.backward(loss)
        opt.step()
    except NonFiniteError as err:
        errors[step] = str(err)
    opt.zero_grad()
fabric.barrier("end")  # both ranks are still in step
report(fabric, errors=errors, finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()))
