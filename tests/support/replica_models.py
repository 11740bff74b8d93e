"""The model, data and loop of the replica-group jobs (tests/support/jobs/replica_groups_*.py), and the
single-process reference that replays what N groups train: the mean over the groups that took part in a step of
their mean-loss gradients, one AdamW step after clipping, as ``phalanx run --replica-groups N`` computes it."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

BATCH = 8
LR = 1e-2


def started() -> float:
    """When this process began (the kernel's record: /proc/self/stat's start time after boot)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    lines = Path("/proc/stat").read_text().splitlines()
    boot = next(int(line.split()[1]) for line in lines if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def dataset() -> TensorDataset:
    data = torch.Generator().manual_seed(0)
    x = torch.randn(1536, 16, generator=data)
    y = x @ torch.randn(16, 1, generator=data) + 0.1 * torch.randn(1536, 1, generator=data)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def make_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)


def full_loss(model: nn.Module) -> float:
    x, y = dataset().tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def crc(model: nn.Module) -> int:
    value = 0
    for tensor in model.state_dict().values():
        local = tensor.to_local() if callable(getattr(tensor, "to_local", None)) else tensor  # FSDP: this rank's shard
        value = zlib.crc32(local.detach().contiguous().view(torch.uint8).numpy().tobytes(), value)
    return value


def _batches(groups: int, seed: int) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, each group's batch: group g reads shard g of a DistributedSampler over every group."""
    data = dataset()
    samplers: list[DistributedSampler[Any]] = [
        DistributedSampler(data, num_replicas=groups, rank=g, shuffle=True, seed=seed) for g in range(groups)
    ]
    epoch = 0
    while True:
        orders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for start in range(0, len(orders[0]), BATCH):
            yield [data[torch.tensor(order[start:start + BATCH])] for order in orders]
        epoch += 1


def reference(steps: int, groups: int, absent: dict[int, set[int]]) -> nn.Module:
    """The model after ``steps`` steps of ``groups`` groups, where ``absent[k]`` did not take part in step k."""
    torch.manual_seed(0)  # group 0's initial weights (the others take them at step 0)
    model = make_model()
    optimizer, scheduler = make_optimizer(model)
    batches = _batches(groups, seed=0)
    for step in range(steps):
        per_group = next(batches)
        present = [g for g in range(groups) if g not in absent.get(step, set())]
        optimizer.zero_grad()
        grads = []
        for g in present:
            model.zero_grad()
            x, y = per_group[g]
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        for i, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).sum(0) / len(present)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return model
