"""DDP training through setup_dataloaders, setup and setup_optimizers, verified in sync.

Run by tests/strategies/test_ddp.py.
"""

import torch
from ddp_models import make_data, make_model
from job_runner import flat_params, report
from torch.utils.data import DataLoader, TensorDataset

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
x, y = make_data()
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=4))
model = fabric.setup(make_model())  # an optimizer over another instance's parameters is refused
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
for _epoch in range(2):
    for xb, yb in loader:
        opt.zero_grad()
        fabric.backward(torch.nn.functional.cross_entropy(model(xb), yb))
        opt.step()
fabric.verify_in_sync(model)
report(fabric, params=flat_params(model))
