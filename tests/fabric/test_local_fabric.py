"""A one-process Fabric inside a running multi-process job: local work on one rank, as Lightning allows.

LitGPT's ``finetune_lora`` ends with ``merge_lora`` on rank 0, which builds ``Fabric(devices=1,
accelerator="cpu")`` inside the 2-process job. As the *first* Fabric of a launched job, ``devices=1`` is
still refused (``torchrun --nproc-per-node 2`` around it would train two copies silently); created while
a phalanx Fabric runs the job, it is a deliberate local Fabric: rank 0 of 1, collectives that are the
identity, a barrier that waits for no one, single-process checkpoint I/O, and a teardown that leaves the
job's process group alone. One real 2-rank gloo job checks both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mp import run_job

pytestmark = pytest.mark.timeout(180)

JOB = r'''
import os
import sys
import torch
from phalanx import Fabric
from phalanx.utils.errors import MisconfigurationError
from mp import report

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
out = {"refused": refused}
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
'''


@pytest.mark.parametrize("launch", ["script", "cli"])
def test_local_fabric_on_one_rank_inside_a_two_process_job(tmp_path: Path, launch: str) -> None:
    # cli: `phalanx run --devices 2`, whose flag must not turn the local Fabric into a second job Fabric
    command = [sys.executable, "-m", "phalanx.cli", "run", "--devices", "2"] if launch == "cli" else None
    job = run_job(JOB, tmp_path, timeout=150, env={"PHALANX_GUARD_TIMEOUT": "20"}, command=command,
                  args=(launch,)).check()
    assert sorted(job.reports) == [0, 1], job.output[-3000:]
    for out in job.reports.values():
        if launch == "script":
            # The first Fabric of the job asks for one process where two were launched: refused, naming the fix.
            refused = "asks for devices=1, num_nodes=1 (1 processes), but torchelastic started 2 process(es)"
            assert refused in out["refused"], out
        assert out["group_alive"] and out["params_equal"] and out["job_ckpt"], out
        assert out["sum"] == 3.0, out
    local = job.reports[0]
    assert local["before_launch"] == [0, 1, True]
    assert local["after_setup"] == [0, 1, "single"]
    assert local["all_reduce"] == 3.0 and local["all_gather"] == [1, 2] and local["broadcast"] == "mine"
    assert local["loaded_back"] and local["rest"] == {"step": 7} and local["file"]
