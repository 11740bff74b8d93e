"""A second Fabric inside a launched Trainer job.

Run by tests/trainer/test_trainer_dist.py: test_a_second_fabric_in_the_same_processes_takes_the_group_over.
"""

import torch
from job_runner import report

import phalanx
from phalanx.utils.errors import MisconfigurationError

first = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
first.launch()
one = first.all_reduce(torch.tensor(float(first.global_rank)), reduce_op="sum")
second = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
second.launch()  # takes the process group (and its guard) over from `first`
two = second.all_reduce(torch.tensor(float(second.global_rank + 1)), reduce_op="sum")
try:
    first.barrier()
    stale = ""
except MisconfigurationError as err:
    stale = str(err)
try:
    phalanx.Fabric(accelerator="cpu", devices=2, strategy=phalanx.strategies.DDPStrategy(guard_timeout=3)).launch()
    differs = ""
except MisconfigurationError as err:
    differs = str(err)
third = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
third.launch()  # a refused take-over left `second` holding the group: a correct one still works
three = third.all_reduce(torch.tensor(1.0), reduce_op="sum")
report(third, one=float(one), two=float(two), three=float(three), stale=stale, differs=differs)
