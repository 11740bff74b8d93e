"""The models, data and tensor-parallel plans of the model-parallel jobs and of their single-process references
(tests/strategies/test_model_parallel.py, test_compile_checkpointing.py, tests/checkpoint/test_async_sharded.py)."""

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import phalanx


class FeedForward(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> Any:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([FeedForward(), FeedForward()])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def parallelize(model: Any, mesh: DeviceMesh) -> Any:
    """Megatron-style MLP split over 'tensor_parallel', each block and the root sharded over 'data_parallel'."""
    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def make_data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


class LitNet(phalanx.Module):
    """Net under the Trainer; logs a per-sample count with reduce_fx="sum" (each sample counted once)."""
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x: torch.Tensor) -> Any:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("train_samples", float(len(x)), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y), sync_dist=True)
        self.log("val_samples", float(len(x)), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def parallelize_lit(module: LitNet, mesh: DeviceMesh) -> LitNet:
    parallelize(module.net, mesh)  # the strategy shards the LitNet root itself
    return module


def full(t: Any) -> Any:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().reshape(-1).double().cpu()


def full_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([full(p) for p in model.parameters()])


def opt_state(model: nn.Module, opt: Any) -> torch.Tensor:
    return torch.cat([full(opt.state[p][k]) for p in model.parameters() for k in ("exp_avg", "exp_avg_sq", "step")])


def one_more_step(fabric: phalanx.Fabric, model: Any, opt: Any) -> None:
    """One Adam step on the global batch x[0:8], whatever the mesh shape (a checkpoint's continuation)."""
    x, y = make_data()
    dp = fabric.strategy.distributed_sampler_kwargs() or {"num_replicas": 1, "rank": 0}
    size = 8 // dp["num_replicas"]
    lo = size * dp["rank"]
    opt.zero_grad()
    fabric.backward(torch.nn.functional.cross_entropy(model(x[lo : lo + size]), y[lo : lo + size]))
    opt.step()
