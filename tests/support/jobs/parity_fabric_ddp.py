"""The same loop as parity_raw_ddp, through Fabric.

Run by tests/integration/test_parity.py: test_fabric_ddp_equals_raw_torch_ddp_and_one_process.
"""

import torch
from job_runner import report
from parity_models import dataset, flat, make_model
from torch import nn
from torch.utils.data import DataLoader

import phalanx as L

fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
model = make_model()
model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=4))
for _epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x).squeeze(1), y))
        opt.step()
report(fabric, params=flat(model))
