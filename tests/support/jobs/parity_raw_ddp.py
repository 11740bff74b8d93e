"""A raw torch DDP loop under torchrun.

Run by tests/integration/test_parity.py: test_fabric_ddp_equals_raw_torch_ddp_and_one_process.
"""

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from parity_models import dataset, flat, make_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DistributedDataParallel(make_model())
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sampler: DistributedSampler[Any] = DistributedSampler(dataset(), num_replicas=2, rank=rank, shuffle=False)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in DataLoader(dataset(), batch_size=4, sampler=sampler):
        opt.zero_grad()
        nn.functional.mse_loss(model(x).squeeze(1), y).backward()
        opt.step()
out = os.environ["PHALANX_TEST_OUT"]
with open(f"{out}/raw{rank}.json", "w") as fh:
    json.dump(flat(model.module).tolist(), fh)
dist.destroy_process_group()
