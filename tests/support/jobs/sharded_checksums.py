"""A sharded checkpoint's checksums, written and verified by 2 ranks.

Run by tests/checkpoint/test_checksums.py: test_flipped_bytes_in_a_shard_file_are_refused_on_every_rank.
"""

from pathlib import Path
from typing import Any, cast

import torch
from job_runner import report

import phalanx
from phalanx.strategies import FSDPStrategy
from phalanx.utils.errors import CheckpointError

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy())
fabric.launch()
r = fabric.global_rank

def build(seed: int) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return fabric.setup(model, opt)

def full(model: Any) -> Any:
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])

model, opt = build(0)
fabric.backward(model(torch.randn(4, 32)).sum())
opt.step()
fabric.save("step1", {"model": model, "optimizer": opt, "step": 1})
fabric.save("step2", {"model": model, "optimizer": opt, "step": 2})
cast(FSDPStrategy, fabric.strategy).async_save = True
handle = fabric.save("async3", {"model": model, "optimizer": opt, "step": 3})
cast(FSDPStrategy, fabric.strategy).async_save = False
fabric.load("step1", {"model": build(1)[0]})  # waits for the asynchronous save on every rank
# Rank 1's shard of the first weight: its bytes are in rank 1's file only.
Path(f"shard{r}.bin").write_bytes(model[0].weight.to_local().detach().contiguous().numpy().tobytes())
fabric.barrier()
if r == 0:
    from byte_flips import flip
    flip(Path("step2") / "__1_0.distcp", Path("shard1.bin").read_bytes())
fabric.barrier()
out = {}
for name in ("step2", "step1", "async3"):
    fresh, fresh_opt = build(1)
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    try:
        fabric.load(name, state)
        out[name] = torch.equal(full(fresh), full(model)) and state["step"] > 0
    except CheckpointError as err:
        out[name] = f"{type(err).__name__}: {err}"
report(fabric, **out)
