"""Prints the weights that Fabric.init_module(empty_init=True) and the program's own init give, under phalanx or
Lightning (argv[1]).

Run by tests/fabric/test_empty_init.py: test_same_weights_as_lightning.
"""

import json
import sys

import torch
from torch import nn

if sys.argv[1] == "lightning":
    from lightning.fabric import Fabric
else:
    from phalanx import Fabric
fabric = Fabric(accelerator="cpu", devices=1)
torch.manual_seed(1)
with fabric.init_module(empty_init=True):
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
for p in model.parameters():  # the program's own initialisation, as litgpt's
    nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.zeros_(p)
print(json.dumps([round(v, 7) for p in model.parameters() for v in p.detach().reshape(-1).tolist()]))
