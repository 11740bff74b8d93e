"""ModelParallelStrategy training equals one process (run by tests/strategies/test_model_parallel.py: trained)."""

from typing import cast

import torch
from job_runner import report
from model_parallel_models import full_params, make_data, make_model, one_more_step, opt_state, parallelize
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.strategies import ModelParallelStrategy
from phalanx.utils.errors import GradientSyncError, MisconfigurationError

torch.set_num_threads(1)
fabric = phalanx.Fabric(accelerator="cpu", devices=4, strategy=ModelParallelStrategy(parallelize, 2, 2))
fabric.launch()
mesh = cast(ModelParallelStrategy, fabric.strategy).device_mesh
dp = mesh["data_parallel"].get_local_rank()
x, y = make_data()
ce = torch.nn.functional.cross_entropy

# Data: tensor-parallel peers read the same samples, data-parallel ranks different ones.
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(16)), batch_size=2, shuffle=True))
report(fabric, coords=mesh.get_coordinate(), seen=[int(i) for (b,) in loader for i in b],
       sampler=fabric.strategy.distributed_sampler_kwargs())

# A: Adam + clipping by the global norm (over both mesh dimensions), optimizer built before setup.
model2 = make_model()
model, opt = fabric.setup(model2, torch.optim.Adam(model2.parameters(), lr=0.01))
norms = []
for i in range(0, 32, 8):
    opt.zero_grad()
    lo = i + 4 * dp
    fabric.backward(ce(model(x[lo : lo + 4]), y[lo : lo + 4]))
    norm = fabric.clip_gradients(model, opt, max_norm=0.5)
    assert norm is not None
    norms.append(norm.item())
    opt.step()
report(fabric, a=full_params(model), a_norms=norms)

# Checkpoints of the 2 x 2 run (sharded directory and full file), then one more step for reference.
state = {"model": model, "optimizer": opt, "step": 4}
fabric.save("ckpt", state)
cast(ModelParallelStrategy, fabric.strategy).state_dict_type = "full"
fabric.save("ckpt.pt", state)
cast(ModelParallelStrategy, fabric.strategy).state_dict_type = "sharded"
report(fabric, a_opt=opt_state(model, opt))
one_more_step(fabric, model, opt)
report(fabric, a_after=full_params(model))


# B: gradient accumulation (2 micro-batches per step); the first skips the data-parallel reduce.
model = fabric.setup_module(make_model())
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
skipped = []
for i in range(0, 32, 8):
    opt.zero_grad()
    for j, micro in enumerate((0, 2)):
        lo = i + 4 * dp + micro
        with fabric.no_backward_sync(model, enabled=j == 0):
            fabric.backward(ce(model(x[lo : lo + 2]), y[lo : lo + 2]) / 2)
        if j == 0:
            skipped.append(all(p.grad is None for p in model.parameters()))
    opt.step()
report(fabric, b=full_params(model), skipped=skipped)

# Stepping after a backward that skipped the reduce must raise (as under FSDP and DDP).
with fabric.no_backward_sync(model):
    fabric.backward(ce(model(x[:4]), y[:4]))
try:
    opt.step()
    report(fabric, step_error=None)
except GradientSyncError as err:
    report(fabric, step_error=str(err))

# Misuse, each refused at setup with the fix (the strategy's function is swapped per case).
cases = {
    "no_fn": None,
    "returns_other": lambda model, mesh: torch.compile(model),
    "not_data_parallel": lambda model, mesh: fully_shard(model, mesh=mesh["tensor_parallel"]),
    "foreign_mesh": lambda model, mesh: fully_shard(model, mesh=init_device_mesh("cpu", (4,))),
}
for name, fn in cases.items():
    cast(ModelParallelStrategy, fabric.strategy).parallelize_fn = fn
    try:
        fabric.setup_module(make_model())
        report(fabric, **{name: None})
    except MisconfigurationError as err:
        report(fabric, **{name: str(err)})
