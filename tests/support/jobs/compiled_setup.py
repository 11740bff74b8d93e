"""A model compiled before fabric.setup, on 2 ranks.

Run by tests/fabric/test_compiled.py: test_compiled_module_under_ddp.
"""

from typing import Any, cast

import torch
from job_runner import report
from torch import nn

import phalanx


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> Any:
        return self.lin(x).relu()

calls: list[Any] = []

def backend(gm: Any, inputs: Any) -> Any:
    calls.append(1)
    return gm.forward

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
torch.manual_seed(0)
net = Net()
model, optimizer = fabric.setup(cast(nn.Module, torch.compile(net, backend=backend)),
                                torch.optim.SGD(net.parameters(), lr=0.1))
x = torch.randn(4, 3) + fabric.global_rank
fabric.backward(model(x).sum())
optimizer.step()
report(fabric, calls=len(calls), keys=list(model.state_dict()), original=model.module is net,
       weight=net.lin.weight)
