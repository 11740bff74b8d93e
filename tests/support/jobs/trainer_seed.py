"""Seeding of the ranks of a Trainer.

Run by tests/trainer/test_trainer_dist.py: test_ranks_seeded_differently_still_shard_one_permutation.
"""

import torch
from job_runner import report
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.trainer.loaders import prepare_train_loader

fabric = phalanx.Fabric(accelerator="cpu", devices=2)
fabric.launch()
phalanx.seed_everything(100 + fabric.global_rank)  # each rank seeded differently on purpose (e.g. dropout)
data = TensorDataset(torch.arange(16))
fabric_loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
trainer_loader, _ = prepare_train_loader(DataLoader(data, batch_size=4, shuffle=True), fabric, True)
report(fabric, fabric_order=[int(i) for (batch,) in fabric_loader for i in batch],
       trainer_order=[int(i) for (batch,) in trainer_loader for i in batch])
