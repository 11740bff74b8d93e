"""Writes a DeepSpeed checkpoint directory for phalanx ckpt.

Run by tests/cli/test_ckpt.py: test_deepspeed_directory_converts_to_every_target.
"""

from typing import cast

import torch
from ckpt_command_models import mlp

import phalanx
from phalanx.strategies import DeepSpeedStrategy

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=DeepSpeedStrategy(stage=2))
fabric.launch()
model = mlp()
model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
for _step in range(2):
    fabric.backward(model(torch.randn(4, 6)).pow(2).mean())
    opt.step()
    opt.zero_grad()
fabric.save("ds", {"model": model, "optimizer": opt, "step": 2})
cast(DeepSpeedStrategy, fabric.strategy).state_dict_type = "full"
fabric.save("ds.pt", {"model": model, "optimizer": opt, "step": 2})
