"""One rank crashes (run by tests/distributed/test_watchdog.py: test_launchers_print_the_failed_ranks_cause)."""

import torch

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2)
fabric.launch()
model = fabric.setup(torch.nn.Linear(3, 1))
if fabric.global_rank == 1:
    raise KeyError("missing_column")
fabric.barrier()
