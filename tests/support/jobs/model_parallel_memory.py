"""Peak memory of a model-parallel setup, initialised on argv[1] (meta|eager).

Run by tests/strategies/test_model_parallel.py: test_meta_init_materializes_only_local_shards.
"""

import resource
import sys
from typing import Any, cast

import torch
from job_runner import report
from model_parallel_models import FeedForward, parallelize
from torch import nn

import phalanx
from phalanx.strategies import ModelParallelStrategy

torch.set_num_threads(1)


class Big(nn.Module):
    def __init__(self, d: int = 1024, layers: int = 12) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(FeedForward(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> Any:
        for block in self.blocks:
            x = block(x)
        return x


def peak_mib() -> Any:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


fabric = phalanx.Fabric(accelerator="cpu", devices=4, strategy=ModelParallelStrategy(parallelize, 2, 2))
fabric.launch()
fabric.seed_everything(3)
empty = sys.argv[1] == "meta"
before = peak_mib()
with fabric.init_module(empty_init=empty):
    model: Any = Big()
full_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
model = fabric.setup_module(model)
after_setup = peak_mib()
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
shard = fabric.strategy.distributed_sampler_kwargs()
assert shard is not None
x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(shard["rank"]))
fabric.backward(model(x).pow(2).mean())
opt.step()
after_step = peak_mib()
local = {n: float(p.to_local().double().sum()) for n, p in model.module.named_parameters() if n.startswith("blocks.0.")}
report(fabric, full_mib=full_mib, setup_mib=after_setup - before, step_mib=after_step - before,
       coords=cast(ModelParallelStrategy, fabric.strategy).device_mesh.get_coordinate(), local=local,
       finite=all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters()))
