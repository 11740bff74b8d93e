"""A nan/inf loss in a 2-rank Fabric loop (run by tests/fabric/test_anomaly.py: test_two_ranks)."""


import torch
from job_runner import report
from torch import nn

import phalanx
from phalanx.utils.errors import MisconfigurationError

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()

# empty_init under DDP: no random number is drawn
torch.manual_seed(5)
before = torch.get_rng_state()
with fabric.init_module(empty_init=True):
    made = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
report(fabric, rng_untouched=bool(torch.equal(before, torch.get_rng_state())))

# backward on a module that was never set up: refused (its gradients would not sync)
inner = nn.Linear(4, 1)
try:
    fabric.backward(inner(torch.randn(2, 4)).sum())
    report(fabric, unmanaged=None)
except MisconfigurationError as err:
    report(fabric, unmanaged=str(err))

# a nan loss on rank 1 only, at the 3rd backward call
torch.manual_seed(0)
model = nn.Linear(4, 1)
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
# A tensor is a map-style dataset at run time (it has __getitem__ and __len__).
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=4))  # type: ignore[arg-type]
for step, x in enumerate(loader, start=1):
    if step == 3 and fabric.global_rank == 1:
        x = x.clone()
        x[0, 0] = float("nan")
    fabric.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
report(fabric, steps=step)
