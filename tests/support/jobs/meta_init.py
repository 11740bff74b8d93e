"""Meta-device initialisation on argv[1] ranks, for the models named after it.

Run by tests/strategies/test_meta_init.py: test_sharded_meta_init_equals_one_process.
"""

import sys
from typing import Any

import torch
from job_runner import report
from meta_init_models import Net
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import phalanx
from phalanx.strategies import FSDPStrategy, ModelParallelStrategy


def like_litgpt(model: Any, mesh: Any) -> Any:  # litgpt.finetune.lora.parallelize_fn, without activation checkpointing
    for m in reversed(list(model.modules())):
        if isinstance(m, nn.Linear) and m.weight.requires_grad:
            fully_shard(m, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def tensor_parallel(model: Any, mesh: Any) -> Any:
    parallelize_module(model, mesh["tensor_parallel"],
                       {"head": ColwiseParallel(), "blocks.0.linear": RowwiseParallel()})
    return model


# tensor parallel inside, FSDP across: FSDP shards TP shards (strided placements)
def two_d(model: Any, mesh: Any) -> Any:
    tensor_parallel(model, mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


strategies = {
    "fsdp": lambda: FSDPStrategy(),
    "litgpt": lambda: ModelParallelStrategy(like_litgpt, data_parallel_size=2, tensor_parallel_size=1),
    "tp": lambda: ModelParallelStrategy(tensor_parallel, data_parallel_size=1, tensor_parallel_size=2),
    "2x2": lambda: ModelParallelStrategy(two_d, data_parallel_size=2, tensor_parallel_size=2),
}
devices, names = int(sys.argv[1]), sys.argv[2:]
for name in names:
    fabric = phalanx.Fabric(accelerator="cpu", devices=devices, strategy=strategies[name]())
    fabric.launch()
    torch.manual_seed(5)
    with fabric.init_module(empty_init=True):
        net = Net()
    fabric.setup_module(net)
    tensors = {n: t for n, t in [*net.named_parameters(), *net.named_buffers()]}
    report(fabric, **{name: {
        "sharded": sorted(n for n, t in tensors.items() if isinstance(t, DTensor)),
        "full": {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach() for n, t in tensors.items()},
        "next_draw": torch.rand(3),
    }})
