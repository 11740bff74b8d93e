"""Fabric's collectives on 2 ranks: all_reduce, all_gather, broadcast, rank_zero_first, the rank properties.

Run by tests/strategies/test_ddp.py.
"""

from typing import Any

import torch
from job_runner import report

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2)
fabric.launch()
r = fabric.global_rank
t = torch.tensor([1.0, 2.0]) * (r + 1)
def fresh() -> Any:
    return t.clone()  # all_reduce writes its result into its input (Lightning's meaning)
order = []
with fabric.rank_zero_first():
    order.append(r)
report(
    fabric,
    mean=fabric.all_reduce(fresh()),
    sum=fabric.all_reduce(fresh(), reduce_op="sum"),
    max=fabric.all_reduce(fresh(), reduce_op="max"),
    scalar=fabric.all_reduce(3.0 * (r + 1), reduce_op="sum"),
    gathered=fabric.all_gather(t),
    nested=fabric.all_gather({"a": torch.tensor([r])}),
    broadcast=fabric.broadcast({"from": r, "data": [r, r]}, src=1),
    ranks=[fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size, fabric.is_global_zero],
)
fabric.barrier("end")
