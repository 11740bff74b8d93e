"""2 ranks with dataloaders of 16 and 12 samples (the user shards the data, not phalanx); with argv[1] ``True`` they
accumulate over two batches (run by tests/fabric/test_bad_input.py)."""

import sys

import torch
from job_runner import report
from torch.utils.data import DataLoader, TensorDataset

import phalanx

ACCUMULATE = sys.argv[1] == "True"
fabric = phalanx.Fabric(accelerator="cpu", devices=2)
fabric.launch()
r = fabric.global_rank
torch.manual_seed(0)
n = [16, 12][r]
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(n, 4), torch.randn(n, 1)), batch_size=4),
                                  use_distributed_sampler=False)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = fabric.setup(model, opt)
try:
    for _epoch in range(2):
        for i, (x, y) in enumerate(loader):
            # accumulate: only the second batch of a pass syncs (a trailing partial window stays local)
            local = ACCUMULATE and i != 1
            with fabric.no_backward_sync(model, enabled=local):
                fabric.backward((model(x) - y).pow(2).mean())
            if not local:
                opt.step()
                opt.zero_grad()
except Exception as err:
    report(fabric, error=type(err).__name__, message=str(err))
    raise
