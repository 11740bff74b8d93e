"""Saves asynchronously and loads back, on the strategy in argv[1].

Run by tests/checkpoint/test_async_sharded.py: test_async_save_round_trip_and_failure.
"""

import errno
import sys
from pathlib import Path
from typing import Any

import torch
from job_runner import report
from model_parallel_models import full_params, make_model, one_more_step, opt_state, parallelize
from torch.distributed.checkpoint.filesystem import FileSystemWriter

import phalanx
from phalanx.checkpoint import async_sharded, storage
from phalanx.strategies import FSDPStrategy, ModelParallelStrategy
from phalanx.utils.errors import CheckpointError

torch.set_num_threads(1)
strategy = (FSDPStrategy(async_save=True) if sys.argv[1] == "fsdp"
            else ModelParallelStrategy(parallelize, 2, 1, async_save=True))
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
m = make_model()
model, opt = fabric.setup(m, torch.optim.Adam(m.parameters(), lr=0.01))
one_more_step(fabric, model, opt)

handle = fabric.save("first", {"model": model, "optimizer": opt, "step": 1})
assert handle is not None
report(fabric, at_save=full_params(model), opt_at_save=opt_state(model, opt))
for _ in range(3):  # training goes on while the shards are written
    one_more_step(fabric, model, opt)
handle.wait()
report(fabric, handle=type(handle).__name__, done=handle.done(), published=Path("first").is_dir())

# The next save waits for nothing now; a load right after an asynchronous save reads that save.
handle = fabric.save("ckpt", {"model": model, "optimizer": opt, "step": 4})
at_save2 = full_params(model)
one_more_step(fabric, model, opt)
m = make_model()
fresh, fresh_opt = fabric.setup(m, torch.optim.Adam(m.parameters(), lr=0.01))
state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
fabric.load("ckpt", state)
report(fabric, loaded=full_params(fresh), at_save2=at_save2, step=state["step"])

# A background write that fails (here: rank 1's storage) is raised on every rank at the next save,
# and the checkpoint in place stays the previous one.
original: Any = FileSystemWriter.write_data
def broken(self: Any, plan: Any, planner: Any) -> None:
    raise OSError(28, "No space left on device")
if fabric.global_rank == 1:
    FileSystemWriter.write_data = broken  # type: ignore[method-assign,assignment]  # the job injects a fault
handle = fabric.save("ckpt", {"model": model, "optimizer": opt, "step": 99})
assert handle is not None
try:
    handle.wait()  # local: this rank's part ended (torch tells every rank when one rank's write failed)
    report(fabric, local_failure=None)
except CheckpointError as err:
    report(fabric, local_failure=str(err))
FileSystemWriter.write_data = original  # type: ignore[method-assign]
try:
    fabric.save("other", {"model": model})
    report(fabric, failure=None)
except CheckpointError as err:
    report(fabric, failure=str(err))
state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
fabric.load("ckpt", state)
report(fabric, step_after_failure=state["step"])

# Rank 0 cannot publish (a read-only mount): the other rank, whose shards were written, hears of it too.
original = storage._move_into_place
def read_only(tmp: Any, path: Any, exchange: Any) -> None:
    raise OSError(errno.EROFS, "Read-only file system", str(path))
if fabric.global_rank == 0:
    storage._move_into_place = read_only
handle = fabric.save("ckpt", {"model": model, "optimizer": opt, "step": 123})
assert handle is not None
try:
    handle.wait()  # the publish runs in the background: keep the failure in place until it is done
    report(fabric, local_publish_failure=None)
except CheckpointError as err:
    report(fabric, local_publish_failure=str(err))
storage._move_into_place = original
try:
    fabric.load("ckpt", state)
    report(fabric, publish_failure=None)
except CheckpointError as err:
    report(fabric, publish_failure=str(err))
fabric.load("ckpt", state)
leftovers = sorted(p.name for p in Path(".").iterdir() if p.name.startswith(".ckpt"))
report(fabric, step_after_publish_failure=state["step"], leftovers=leftovers)

# Copying the shards fails on rank 1 (out of memory): every rank raises before any write starts.
stage = async_sharded._ReusedStaging.stage
def no_memory(self: Any, tensors: Any) -> None:
    raise MemoryError("cannot allocate the staging copy")
if fabric.global_rank == 1:
    async_sharded._ReusedStaging.stage = no_memory  # type: ignore[method-assign,assignment]  # the job injects a fault
try:
    fabric.save("ckpt", {"model": model, "optimizer": opt, "step": 77})
    report(fabric, stage_failure=None)
except CheckpointError as err:
    report(fabric, stage_failure=str(err))
async_sharded._ReusedStaging.stage = stage  # type: ignore[method-assign]
fabric.load("ckpt", state)
leftovers = sorted(p.name for p in Path(".").iterdir() if p.name.startswith(".ckpt"))
report(fabric, step_after_stage_failure=state["step"], leftovers_after_stage_failure=leftovers)
