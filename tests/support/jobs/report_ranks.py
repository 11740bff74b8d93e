"""2 processes all-reduce their rank + 1 and report the total and their ranks (global, local, node, world size); on
one node, or (argv[1] ``2``) on two nodes of one process each (run by tests/distributed/test_launch.py)."""

import sys

import torch
from job_runner import report

import phalanx

TWO_NODES = sys.argv[1:] == ["2"]
fabric = (phalanx.Fabric(accelerator="cpu", devices=1, num_nodes=2) if TWO_NODES
          else phalanx.Fabric(accelerator="cpu", devices=2))
fabric.launch()
total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum")
report(fabric, total=total, ranks=[fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size])
