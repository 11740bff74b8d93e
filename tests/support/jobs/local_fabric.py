"""A local Fabric(devices=1) inside a 2-rank job.

Run by tests/fabric/test_local_fabric.py: test_local_fabric_on_one_rank_inside_a_two_process_job.
"""

import os
import sys
from typing import Any

import torch
from job_runner import report

from phalanx import Fabric
from phalanx.utils.errors import MisconfigurationError

fabric = Fabric(accelerator="cpu", devices=2)
refused = None
# In the two ranks, before the job's group exists (`python job.py`: the script re-runs there). Under
# `phalanx run --devices 2` the flag makes any Fabric of the script a 2-process one until the job runs.
if "RANK" in os.environ and sys.argv[1] == "script":
    first = Fabric(accelerator="cpu", devices=1)
    try:
        first.launch()
        refused = ""
    except MisconfigurationError as err:
        refused = str(err)
fabric.launch()
rank = fabric.global_rank
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
fabric.backward(model(torch.ones(3, 4) * (rank + 1)).sum())
opt.step()
out: dict[str, Any] = {"refused": refused}
if rank == 0:  # rank 1 is already waiting in the job's barrier below
    local = Fabric(accelerator="cpu", devices=1)
    out["before_launch"] = [local.global_rank, local.world_size, local.is_global_zero]
    torch.manual_seed(1)
    small = torch.nn.Linear(3, 3)
    small_opt = torch.optim.SGD(small.parameters(), lr=0.1)
    small, small_opt = local.setup(small, small_opt)
    out["after_setup"] = [local.global_rank, local.world_size, local.strategy.name]
    local.barrier()  # must not wait for rank 1
    out["all_reduce"] = local.all_reduce(torch.tensor(3.0), reduce_op="sum").item()
    out["all_gather"] = list(local.all_gather(torch.tensor([1.0, 2.0])).shape)
    out["broadcast"] = local.broadcast("mine")
    path = "local.ckpt"
    local.save(path, {"model": small, "step": 7})
    saved = [p.detach().clone() for p in small.parameters()]
    with torch.no_grad():
        for p in small.parameters():
            p.zero_()
    rest = local.load(path, {"model": small})
    out["loaded_back"] = all(torch.equal(a, b) for a, b in zip(saved, small.parameters()))
    out["rest"] = rest
    out["file"] = os.path.isfile(path)
    local.teardown()
out["group_alive"] = torch.distributed.is_initialized()
fabric.barrier()
out["sum"] = fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item()
gathered = fabric.all_gather(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
out["params_equal"] = torch.equal(gathered[0], gathered[1])
fabric.save("job.ckpt", {"model": model})
out["job_ckpt"] = os.path.exists("job.ckpt")
report(fabric, **out)
