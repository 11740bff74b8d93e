"""A job under phalanx run that ends cleanly (run by tests/distributed/test_shutdown.py: _runs)."""

import torch

import phalanx

fabric = phalanx.Fabric(accelerator="cpu")
fabric.launch()
model = fabric.setup(torch.nn.Linear(3, 1))
fabric.backward(model(torch.randn(2, 3)).sum())
fabric.barrier()
fabric.print("done")
