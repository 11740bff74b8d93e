"""The training loop of the activation-checkpointing and compile jobs and of their single-process reference
(tests/strategies/test_compile_checkpointing.py): 4 SGD steps on global batches of 8, each rank taking its
data-parallel part, on the model of tests/support/model_parallel_models.py."""

from typing import Any

import torch
from model_parallel_models import FeedForward, full_params, make_data, make_model

import phalanx

__all__ = ["FeedForward", "calls", "last", "train"]  # FeedForward: the block class the policies name

calls = [0]
last: list[Any] = []  # the set-up model of the latest run, for in-process checks


def train(fabric: phalanx.Fabric) -> dict[str, Any]:
    model = make_model()
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    last[:] = [model]
    split = fabric.strategy.distributed_sampler_kwargs() or {"num_replicas": 1, "rank": 0}
    size = 8 // split["num_replicas"]
    x, y = make_data()
    for i in range(0, 32, 8):
        lo = i + size * split["rank"]
        opt.zero_grad()
        fabric.backward(torch.nn.functional.cross_entropy(model(x[lo : lo + size]), y[lo : lo + size]))
        opt.step()
    compiled = getattr(model._forward_module, "_compiled_call_impl", None) is not None
    return {"params": full_params(model), "block_calls": calls[0], "compiled": compiled}
