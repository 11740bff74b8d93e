"""The job of the topology matrix (tests/checkpoint/test_topology_matrix.py); job scripts import this
module, which holds no tests itself.

One process set (1, 2 or 4 ranks) runs a list of steps given as JSON on the command line, so several
save/load pairs share one start-up. A topology is ``strategy@ranks`` (``single@1``, ``ddp@2``,
``fsdp@2``, ``deepspeed_stage_1@2`` .. ``deepspeed_stage_3@2``, ``ddp@4``, ``model_parallel@4``,
``model_parallel_full@4``); every one trains with the same global batch (``GLOBAL_BATCH`` = data-parallel
ranks x per-rank batch), so the runs agree to float32 rounding. ``model_parallel@4`` is
ModelParallelStrategy on a 2 x 2 mesh (the MLP's layers split over "tensor_parallel", FSDP over
"data_parallel"): its tensor-parallel peers read the same batch, so its per-rank batch is
GLOBAL_BATCH / 2, as on 2 ranks; ``model_parallel_full@4`` saves one full file
(``save_distributed_checkpoint=False``) instead of DCP shards.

Steps:
* ``["fit", topology, dir, max_steps, resume, tag]``: a Trainer fit of ``EPOCHS`` epochs (stopped
  after ``max_steps`` optimizer steps when given: a mid-epoch checkpoint), saving ``last`` into
  ``dir`` every ``SAVE_EVERY`` steps and resuming from it when ``resume``. Reports under ``tag``
  the samples each rank trained on (epoch, index), the step and the final full weights.
* ``["fabric_save", topology, path, tag]`` / ``["fabric_load", topology, path, tag]``: a Fabric loop
  saving model + optimizer after ``FABRIC_STEPS`` steps, and loading it into fresh objects; both
  report the full model and optimizer state (torch's layout) for the test to compare.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from job_runner import report
from torch import nn
from torch.utils.data import DataLoader, Dataset

import phalanx
from phalanx.callbacks import ModelCheckpoint

SAMPLES = 32
GLOBAL_BATCH = 4  # 8 steps per epoch on every topology
EPOCHS = 2
SAVE_EVERY = 5
FABRIC_STEPS = 3
TENSOR_PARALLEL = 2  # model_parallel@4: 2 data-parallel x 2 tensor-parallel ranks


#: DeepSpeed's default buckets hold 5e8 elements: on the CPU each ZeRO engine keeps ~2 GB, and a job that
#: builds several (DeepSpeed does not free them all on destroy) runs the box out of memory.
SMALL_BUCKETS = {"reduce_bucket_size": 2**20, "allgather_bucket_size": 2**20, "stage3_prefetch_bucket_size": 2**20,
                 "stage3_max_live_parameters": 2**20}


def parallelize(module: nn.Module, mesh: Any) -> nn.Module:
    """ModelParallelStrategy's parallelize_fn for ``Recorder``: Megatron's MLP split (first layer by
    columns, last by rows) over "tensor_parallel", FSDP over "data_parallel" (the root: the strategy)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    target = getattr(module, "net", module)
    parallelize_module(target, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(target, mesh=mesh["data_parallel"])
    return module


def data_parallel_ranks(topology: str) -> int:
    """How many different batches one step trains on (tensor-parallel peers share one)."""
    name, ranks = topology.split("@")
    return int(ranks) // TENSOR_PARALLEL if name.startswith("model_parallel") else int(ranks)


def parse(topology: str) -> tuple[Any, int]:
    """The Trainer's/Fabric's strategy argument and the number of ranks."""
    name, ranks = topology.split("@")
    if name.startswith("model_parallel"):  # model_parallel_full: one full file, gathered on rank 0
        from phalanx.strategies import ModelParallelStrategy

        return ModelParallelStrategy(parallelize, tensor_parallel_size=TENSOR_PARALLEL,
                                     save_distributed_checkpoint=not name.endswith("_full")), int(ranks)
    if name.startswith("deepspeed_stage_"):
        from phalanx.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=int(name[-1]), config={"zero_optimization": dict(SMALL_BUCKETS)}), int(ranks)
    return ("auto" if name == "single" else name), int(ranks)


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = (self.x[:, :4].sum(1, keepdim=True) - self.x[:, 4:].prod(1, keepdim=True)).tanh()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def net() -> nn.Module:
    torch.manual_seed(4321)  # the same initial weights in every process and every run
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class Recorder(phalanx.Module):
    """Adam (its state must survive every conversion) on an MLP; records each sample it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.seen: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen += [(self.trainer.current_epoch, int(i)) for i in idx]
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def full_weights(fabric: Any, module: nn.Module) -> list[float]:
    """Every parameter as one flat list, gathered whatever the strategy shards (a collective)."""
    state = fabric.strategy.module_state_dict(module)
    return torch.cat([state[name].detach().reshape(-1).float().cpu() for name, _ in module.named_parameters()]).tolist()


def fit(topology: str, directory: str, max_steps: int | None, resume: bool, tag: str) -> None:
    strategy, ranks = parse(topology)
    phalanx.seed_everything(7)
    ckpt = ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0, every_n_train_steps=SAVE_EVERY)
    trainer = phalanx.Trainer(
        accelerator="cpu", devices=ranks, strategy=strategy, max_epochs=EPOCHS, max_steps=max_steps or -1,
        callbacks=[ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, deterministic=True,
    )
    module = Recorder()
    data = DataLoader(Indexed(), batch_size=GLOBAL_BATCH // data_parallel_ranks(topology), shuffle=True)
    try:
        trainer.fit(module, data, ckpt_path="last" if resume else None)
    except Exception as err:  # reported: the other pairs of this job still run
        report(trainer.fabric, **{tag: {"error": f"{type(err).__name__}: {err}"}})
        return
    parts = trainer.fabric.all_gather_object(module.seen)
    peers = ranks // data_parallel_ranks(topology)  # rank r is at (r // peers, r % peers) on the mesh
    if any(part != parts[r - r % peers] for r, part in enumerate(parts)):
        report(trainer.fabric, **{tag: {"error": "tensor-parallel peers trained on different samples"}})
        return
    seen = [pair for part in parts[::peers] for pair in part]
    report(trainer.fabric, **{tag: {"seen": seen, "step": trainer.global_step, "folder": directory,
                                    "weights": full_weights(trainer.fabric, module)}})


def _fabric(topology: str) -> tuple[Any, nn.Module, Any]:
    strategy, ranks = parse(topology)
    fabric = phalanx.Fabric(accelerator="cpu", devices=ranks, strategy=strategy)
    fabric.launch()
    model = net()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    return fabric, model, optimizer


def _full_state(fabric: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    raw_model = fabric.strategy.unwrap(model.module) if hasattr(model, "module") else model
    opt = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    osd = fabric.strategy.optimizer_state_dict(raw_model, opt)
    return {"weights": full_weights(fabric, raw_model),
            "optimizer": {str(i): {k: v for k, v in s.items()} for i, s in osd["state"].items()}}


def fabric_save(topology: str, path: str, tag: str) -> None:
    fabric, model, optimizer = _fabric(topology)
    g = torch.Generator().manual_seed(fabric.global_rank)
    for _ in range(FABRIC_STEPS):
        x = torch.randn(2, 8, generator=g)
        fabric.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": FABRIC_STEPS})
    report(fabric, **{tag: _full_state(fabric, model, optimizer)})


def fabric_load(topology: str, path: str, tag: str) -> None:
    fabric, model, optimizer = _fabric(topology)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    try:
        fabric.load(path, state)
    except Exception as err:  # reported: a pair that cannot convert must say so clearly
        report(fabric, **{tag: {"error": f"{type(err).__name__}: {err}"}})
        return
    report(fabric, **{tag: {**_full_state(fabric, model, optimizer), "step": state["step"]}})


def main() -> None:
    for step in json.loads(sys.argv[1]):
        kind, args = step[0], step[1:]
        if kind == "fit":
            fit(*args)
        elif kind == "fabric_save":
            fabric_save(*args)
        elif kind == "fabric_load":
            fabric_load(*args)
        else:
            raise ValueError(f"unknown step {kind!r}")
    Path("done").touch()


if __name__ == "__main__":
    main()
