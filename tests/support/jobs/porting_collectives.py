"""Lightning's collective calls, ported.

Run by tests/integration/test_porting_dist.py: test_fabric_collectives_on_two_ranks.
"""

import torch
from job_runner import report

import phalanx as L

fabric = L.Fabric(accelerator="cpu", devices=2)
fabric.launch()
r = fabric.global_rank
t = torch.tensor([float(r + 1)])
returned = fabric.all_reduce(t, reduce_op="sum")
x = torch.full((2,), float(r + 1), requires_grad=True)
gathered = fabric.all_gather(x, sync_grads=True)
# Every rank's loss uses every rank's slice; x.grad must sum the contributions of all ranks' losses.
weights = torch.tensor([[1.0], [10.0]])
((gathered * weights).sum() * (r + 1)).backward()
report(fabric, numbers=fabric.all_gather(r + 1), bools=fabric.all_gather(r == 0).tolist(),
       in_place=t, same_object=returned is t, mean_of_ints=fabric.all_reduce(r + 1),
       max_enum=fabric.all_reduce(float(r), reduce_op=torch.distributed.ReduceOp.MAX),
       gathered=gathered.detach(), grad=x.grad, nested=fabric.all_gather({"a": [r, 2.5]})["a"][0])
