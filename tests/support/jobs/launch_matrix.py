"""The cells of the launch matrix, under the launcher in argv[1] (run by tests/fabric/test_launch_matrix.py: _run)."""

import os
import sys
import time
import traceback
from typing import Any

import torch
import torch.nn.functional as F
from job_runner import report
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

STEPS = 3
LR = 0.05
torch.set_num_threads(1)  # two ranks share the CPU cores


def parallelize(module: Any, device_mesh: Any) -> Any:
    """Megatron-style MLP on the tensor-parallel ranks, then FSDP2 over the data-parallel ones."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    net = getattr(module, "net", module)  # the phalanx.Module under the Trainer, the MLP under Fabric
    parallelize_module(net, device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(net, mesh=device_mesh["data_parallel"])
    return module


def make_strategy(name: str, form: Any) -> Any:
    if form == "str":
        return name
    if name == "ddp":
        return DDPStrategy()
    if name == "fsdp":
        return FSDPStrategy()
    if name == "model_parallel":
        return ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=1, tensor_parallel_size=2)
    if name.startswith("deepspeed_stage_"):
        return DeepSpeedStrategy(stage=int(name[-1]))
    raise ValueError(name)


def parse(cell: str) -> Any:
    name, form, precision = cell.split(",")
    return name, form, precision


def mlp() -> Any:
    torch.manual_seed(7)  # the same initial weights on every rank and in the reference
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def data() -> Any:
    gen = torch.Generator().manual_seed(11)
    # [step, data-parallel shard, sample, feature]: two shards of 4 samples per step
    return torch.randn(STEPS + 2, 2, 4, 8, generator=gen), torch.randn(STEPS + 2, 2, 4, 1, generator=gen)


def flat(state: Any) -> Any:
    return torch.cat([state[key].detach().reshape(-1).double().cpu() for key in sorted(state)])


def reference() -> Any:
    """One process, plain torch, on the concatenated batches of both data-parallel shards."""
    X, Y = data()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        loss = F.mse_loss(model(X[step].reshape(-1, 8)), Y[step].reshape(-1, 1))
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, flat({"net." + k: v for k, v in model.state_dict().items()})


def describe(strategy: Any) -> Any:
    mesh = getattr(strategy, "device_mesh", None) if type(strategy).__name__ == "ModelParallelStrategy" else None
    return {"class": type(strategy).__name__, "precision": strategy.precision.name, "world": strategy.world_size,
            "mesh": None if mesh is None else list(mesh.shape)}


# ------------------------------------------------------------------------------------------- Fabric
def new_fabric(cell: str) -> Any:
    name, form, precision = parse(cell)
    return phalanx.Fabric(accelerator="cpu", devices=2, strategy=make_strategy(name, form), precision=precision)


def fabric_cell(fabric: phalanx.Fabric, cell: str, index: int) -> Any:
    name, form, _ = parse(cell)
    strategy: Any = fabric.strategy  # the cell's: its attributes vary
    model = mlp()
    if name == "model_parallel" and form == "str":
        parallelize(model, strategy.device_mesh)  # strategy="model_parallel": the module comes parallelized
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    shards = strategy.distributed_sampler_kwargs()
    X, Y = data()

    def batch(step: int) -> Any:
        if shards["num_replicas"] == 2:
            return X[step, shards["rank"]], Y[step, shards["rank"]]
        return X[step].reshape(-1, 8), Y[step].reshape(-1, 1)  # one replica (tensor parallel): all of it

    def train(step: int) -> Any:
        x, y = batch(step)
        loss = F.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(fabric.all_reduce(loss.detach().clone(), reduce_op="mean"))

    def params() -> Any:
        return flat({"net." + k: v for k, v in strategy.module_state_dict(model.module).items()})

    losses = [train(step) for step in range(STEPS)]
    trained = params()
    path = f"ckpt-{index}"
    fabric.save(path, {"model": model, "optimizer": opt, "step": STEPS})
    continued = [train(step) for step in range(STEPS, STEPS + 2)]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3 keeps this rank's partition there
                p.ds_tensor.zero_()
    state = {"model": model, "optimizer": opt, "step": -1}
    fabric.load(path, state)
    restored = params()
    resumed = [train(step) for step in range(STEPS, STEPS + 2)]
    ref_losses, ref_params = reference()
    return {
        "strategy": describe(strategy), "shards": shards, "losses": losses, "params": trained,
        "restored_equal": bool(torch.equal(restored, trained)), "step": state["step"],
        "continued": continued, "resumed": resumed,
        "ref_losses": ref_losses, "ref_error": float((trained - ref_params).abs().max()),
    }


def guarded(run: Any, *args: Any) -> Any:
    """A cell that raises (on every rank alike, e.g. a refused setup) is reported; the next cells still run."""
    start = time.perf_counter()
    try:
        return {**run(*args), "seconds": round(time.perf_counter() - start, 2)}
    except Exception as err:
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}"}


def fabric_cells(fabric: phalanx.Fabric | None, cells: list[str], carried: list[Any] | None = None) -> int:
    """``carried``: under launch(fn), the strategy objects of the later cells, configured by a Fabric in the
    launching process and pickled into this one with fn's arguments, as the first cell's strategy was."""
    for index, cell in enumerate(cells):
        if index > 0 or fabric is None:
            if carried and carried[index] is not None:
                fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=carried[index],
                                        precision=parse(cell)[2])
            else:
                fabric = new_fabric(cell)
            fabric.launch()  # re-runs the script (first cell of `launch`), or joins / takes the group over
        report(fabric, **{cell: guarded(fabric_cell, fabric, cell, index)})
    assert fabric is not None
    return fabric.global_rank


# ------------------------------------------------------------------------------------------- Trainer
class Regressor(phalanx.Module):
    def __init__(self, parallelize_here: bool = False) -> None:
        super().__init__()
        self.net = mlp()
        self.parallelize_here = parallelize_here
        self.losses: list[Any] = []

    def forward(self, x: torch.Tensor) -> Any:
        return self.net(x)

    def configure_model(self) -> None:
        # strategy="model_parallel" has no parallelize_fn: the module parallelizes itself, once.
        if self.parallelize_here and not hasattr(self.net[0].weight, "device_mesh"):
            trainer: Any = self.trainer  # the running Trainer, whose strategy is the cell's
            parallelize(self, trainer.strategy.device_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        self.losses.append(float(self.trainer.callback_metrics["loss"]))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).float(), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def new_trainer(cell: str, root: Any) -> Any:
    name, form, precision = parse(cell)
    return phalanx.Trainer(
        accelerator="cpu", devices=2, strategy=make_strategy(name, form), precision=precision, max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=root,
    )


def trainer_cell(cell: str, index: int) -> Any:
    name, form, _ = parse(cell)
    X, Y = data()
    train = DataLoader(TensorDataset(X[:STEPS].reshape(-1, 8), Y[:STEPS].reshape(-1, 1)), batch_size=4)
    val = DataLoader(TensorDataset(X[STEPS:].reshape(-1, 8), Y[STEPS:].reshape(-1, 1)), batch_size=4)
    by_hand = name == "model_parallel" and form == "str"
    trainer = new_trainer(cell, f"trainer-{index}")
    module = Regressor(by_hand)
    trainer.fit(module, train)
    trained_state = trainer.strategy.module_state_dict(module)
    trained = flat(trained_state)
    validated = trainer.validate(module, val, verbose=False)
    path = f"trainer-{index}.ckpt"
    trainer.save_checkpoint(path)
    # A new Trainer resumes the finished fit from the file: it restores everything and trains no further.
    fresh_trainer = new_trainer(cell, f"trainer-{index}-fresh")
    fresh = Regressor(by_hand)
    fresh_trainer.fit(fresh, train, ckpt_path=path)
    restored = flat(fresh_trainer.strategy.module_state_dict(fresh))
    revalidated = fresh_trainer.validate(fresh, val, verbose=False)
    # Only the weights: validate(ckpt_path=...) into another new module, through a third Trainer.
    weights_trainer = new_trainer(cell, f"trainer-{index}-weights")
    other = Regressor(by_hand)
    try:
        from_file = weights_trainer.validate(other, val, ckpt_path=path, verbose=False)
        loaded = weights_trainer.strategy.module_state_dict(other)
        # In the dtype the evaluated module holds: under DeepSpeed in bf16 it is cast to bf16 (no engine
        # keeps float32 masters for it), so it holds the trained float32 weights rounded to bf16.
        as_held = {key: value.to(loaded[key].dtype) for key, value in trained_state.items()}
        weights = {"validate": from_file, "equal": bool(torch.equal(flat(loaded), flat(as_held)))}
    except Exception as err:  # raised on every rank alike
        weights = {"error": f"{type(err).__name__}: {err}"}
    return {
        "strategy": describe(trainer.strategy), "losses": module.losses, "params": trained,
        "steps": trainer.global_step, "resumed_steps": fresh_trainer.global_step,
        "restored_equal": bool(torch.equal(restored, trained)),
        "validate": validated, "revalidate": revalidated, "weights_only": weights,
    }


def trainer_cells(cells: Any) -> None:
    for index, cell in enumerate(cells):
        out = guarded(trainer_cell, cell, index)
        report(rank=int(os.environ.get("RANK", "0")), **{cell: out})  # set in the launched processes


if __name__ == "__main__":
    launch, cells = sys.argv[1], sys.argv[2:]
    if launch == "launch_fn":
        fabrics = [new_fabric(cell) for cell in cells]  # each configures its strategy here
        carried = [f.strategy if parse(cell)[1] == "obj" else None for f, cell in zip(fabrics, cells)]
        print("result", fabrics[0].launch(fabric_cells, cells, carried))
    elif launch == "trainer":
        trainer_cells(cells)
    else:  # launch (re-runs this script), cli and torchrun (already started: launch() joins)
        fabric_cells(None, cells)
