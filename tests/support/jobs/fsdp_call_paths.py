"""Every call path of an FSDP model, wrapped per class or whole (argv[1]: classes|none).

Run by tests/strategies/test_fsdp.py: test_direct_call_of_sharded_child_keeps_grads_correct,
test_direct_call_of_unsharded_child_raises.
"""

import sys
import warnings
from typing import Any

import torch
from fsdp_models import Block, Distill, Net, Teacher, full_grads, make_data, make_model
from job_runner import report

import phalanx
from phalanx.strategies import FSDPStrategy
from phalanx.utils.errors import MisconfigurationError

# argv[1]: "classes" wraps Net, Block and Teacher each in their own FSDP unit, "none" wraps the model whole
POLICY = {"classes": {Net, Block, Teacher}, "none": None}[sys.argv[1]]
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy=POLICY))
fabric.launch()
x, _ = make_data()
xb = x[fabric.global_rank * 8 : (fabric.global_rank + 1) * 8]
model: Any = make_model(Distill)
model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))

def errors(fn: Any) -> Any:
    try:
        fn()
        return None
    except MisconfigurationError as err:
        return str(err)

def distill_step() -> None:
    # The distillation pattern: the student is called directly, before the root ever ran forward.
    loss = ((model.student(xb) - model.teacher(xb)) ** 2).mean()
    fabric.backward(loss)

report(fabric, student_error=errors(distill_step))
report(fabric, student_grads=full_grads(model.student))
fabric.verify_in_sync(model, grads=False)

# A child that is its own sharded unit works on any policy (the blocks of a ModuleList are units).
opt.zero_grad()
fabric.backward(model.student.blocks[0](torch.ones(2, 8) * (1 + fabric.global_rank)).pow(2).sum())
report(fabric, block_grads=full_grads(model.student.blocks[0]))

# An optimizer holding pre-sharding parameters is refused.
plain = make_model()
stale = torch.optim.SGD(plain.parameters(), lr=0.1)
fabric.setup_module(plain)
report(fabric, stale_error=errors(lambda: fabric.setup_optimizers(stale)))

# An optimizer over another (unsharded) model's parameters is refused.
other = make_model()
report(fabric, unrelated_error=errors(lambda: fabric.setup(make_model(), torch.optim.SGD(other.parameters(), lr=0.1))))

# An optimizer that already has state cannot be moved to the sharded parameters.
used = make_model()
used_opt = torch.optim.Adam(used.parameters())
used(x[:2]).sum().backward()
used_opt.step()
report(fabric, state_error=errors(lambda: fabric.setup(used, used_opt)))

# model.state_dict() holds shards only: a one-time hint about torch.save.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.state_dict()
    model.state_dict()
report(fabric, hints=[str(w.message) for w in caught])
