"""The combination tier's launch axis: every strategy, given as a string and as an object, through every
way a job starts, in 32-true and bf16-mixed.

``Fabric(strategy=FSDPStrategy(...)).launch(fn)`` once died before any rank started (a lambda on the
strategy could not be pickled into the new processes) while every combination test passed: they all
named their strategy with a string. Each cell here is (strategy, form, precision) run for real on two
CPU ranks (gloo) through one launch path:

* ``launch``: ``fabric.launch()``, the script re-runs itself in two processes;
* ``launch_fn``: ``fabric.launch(fn)``, the Fabric's arguments (the strategy object) and ``fn`` are
  pickled into two new processes; so is every later cell's strategy object, configured by a Fabric in
  the launching process and sent as one of fn's arguments;
* ``cli``: ``phalanx run --devices 2 job.py``;
* ``torchrun``: ``python -m torch.distributed.run --nproc-per-node 2 job.py``;
* ``trainer``: ``phalanx.Trainer(devices=2, strategy=...)`` with a small ``phalanx.Module``.

Each cell checks that the losses are finite and the same on every rank, that the full (gathered)
parameters are identical across ranks after training (and, in 32-true, equal to one process training
on the concatenated data-parallel batches), and an exact save/load round trip: ``fabric.save``, two
more steps, zeroed parameters, ``fabric.load`` restores the saved parameters bit for bit and the two
steps repeat bit for bit. Trainer: ``trainer.save_checkpoint``, then a new Trainer's
``fit(ckpt_path=...)`` restores a fresh module bit for bit (and trains no further: the fit had ended)
with the same validation loss, and a third Trainer's ``validate(ckpt_path=...)`` loads the weights alone.

Process start-up dominates, so one job runs several cells in the same processes: a later Fabric (or
Trainer) takes over the first one's process group at its ``launch()`` (docs/fabric.md, "A second
Fabric"). The CI tier runs one job per launch path: every strategy in both forms, and on every launch
path both forms and both precisions; the rest of the matrix is ``slow`` (``PHALANX_TEST_ALL=1``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from mp import run_job

from phalanx.strategies import available_strategies

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAS_FSDP = "fsdp" in available_strategies()
RUN_ALL = os.environ.get("PHALANX_TEST_ALL") == "1"

STRATEGIES = ("ddp", "fsdp", "model_parallel", "deepspeed_stage_2", "deepspeed_stage_3")
FORMS = ("str", "obj")
PRECISIONS = ("32-true", "bf16-mixed")
LAUNCHES = ("launch", "launch_fn", "cli", "torchrun", "trainer")

# ---------------------------------------------------------------------------------------------- the job
# argv: <launch path> <cell> [<cell> ...], a cell being "strategy,form,precision". Every cell runs in the
# same two processes, one after the other; each reports under its own key.
JOB = r'''
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from mp import report
from phalanx.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

STEPS = 3
LR = 0.05
torch.set_num_threads(1)  # two ranks share the CPU cores


def parallelize(module, device_mesh):
    """Megatron-style MLP on the tensor-parallel ranks, then FSDP2 over the data-parallel ones."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    net = getattr(module, "net", module)  # the phalanx.Module under the Trainer, the MLP under Fabric
    parallelize_module(net, device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(net, mesh=device_mesh["data_parallel"])
    return module


def make_strategy(name, form):
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


def parse(cell):
    name, form, precision = cell.split(",")
    return name, form, precision


def mlp():
    torch.manual_seed(7)  # the same initial weights on every rank and in the reference
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def data():
    gen = torch.Generator().manual_seed(11)
    # [step, data-parallel shard, sample, feature]: two shards of 4 samples per step
    return torch.randn(STEPS + 2, 2, 4, 8, generator=gen), torch.randn(STEPS + 2, 2, 4, 1, generator=gen)


def flat(state):
    return torch.cat([state[key].detach().reshape(-1).double().cpu() for key in sorted(state)])


def reference():
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


def describe(strategy):
    mesh = getattr(strategy, "device_mesh", None) if type(strategy).__name__ == "ModelParallelStrategy" else None
    return {"class": type(strategy).__name__, "precision": strategy.precision.name, "world": strategy.world_size,
            "mesh": None if mesh is None else list(mesh.shape)}


# ------------------------------------------------------------------------------------------- Fabric
def new_fabric(cell):
    name, form, precision = parse(cell)
    return phalanx.Fabric(accelerator="cpu", devices=2, strategy=make_strategy(name, form), precision=precision)


def fabric_cell(fabric, cell, index):
    name, form, _ = parse(cell)
    strategy = fabric.strategy
    model = mlp()
    if name == "model_parallel" and form == "str":
        parallelize(model, strategy.device_mesh)  # strategy="model_parallel": the module comes parallelized
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    shards = strategy.distributed_sampler_kwargs()
    X, Y = data()

    def batch(step):
        if shards["num_replicas"] == 2:
            return X[step, shards["rank"]], Y[step, shards["rank"]]
        return X[step].reshape(-1, 8), Y[step].reshape(-1, 1)  # one replica (tensor parallel): all of it

    def train(step):
        x, y = batch(step)
        loss = F.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(fabric.all_reduce(loss.detach().clone(), reduce_op="mean"))

    def params():
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


def guarded(run, *args):
    """A cell that raises (on every rank alike, e.g. a refused setup) is reported; the next cells still run."""
    start = time.perf_counter()
    try:
        return {**run(*args), "seconds": round(time.perf_counter() - start, 2)}
    except Exception as err:
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}"}


def fabric_cells(fabric, cells, carried=None):
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
    return fabric.global_rank


# ------------------------------------------------------------------------------------------- Trainer
class Regressor(phalanx.Module):
    def __init__(self, parallelize_here=False):
        super().__init__()
        self.net = mlp()
        self.parallelize_here = parallelize_here
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def configure_model(self):
        # strategy="model_parallel" has no parallelize_fn: the module parallelizes itself, once.
        if self.parallelize_here and not hasattr(self.net[0].weight, "device_mesh"):
            parallelize(self, self.trainer.strategy.device_mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, *args):
        self.losses.append(float(self.trainer.callback_metrics["loss"]))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).float(), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def new_trainer(cell, root):
    name, form, precision = parse(cell)
    return phalanx.Trainer(
        accelerator="cpu", devices=2, strategy=make_strategy(name, form), precision=precision, max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=root,
    )


def trainer_cell(cell, index):
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


def trainer_cells(cells):
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
'''


def _command(launch: str) -> list[str] | None:
    if launch == "cli":
        return [sys.executable, "-m", "phalanx.cli", "run", "--devices", "2"]
    if launch == "torchrun":
        # --standalone: a free port for the rendezvous (parallel test workers must not share 29500)
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return None


def _missing(cell: str) -> str | None:
    """Why ``cell`` cannot run here, or None."""
    name = cell.split(",")[0]
    if name in ("fsdp", "model_parallel") and not HAS_FSDP:
        return "FSDP2 on CPU needs torch >= 2.7"
    if name.startswith("deepspeed") and not HAS_DEEPSPEED:
        return "DeepSpeed is not installed"
    return None


def _check(job: Any, launch: str, cells: list[str]) -> None:
    """Assert every cell's results."""
    assert sorted(job.reports) == [0, 1], job.output[-4000:]
    if launch == "launch_fn":
        assert "result 0" in job.stdout, job.output[-4000:]  # fn's return value, from rank 0
    expected_class = {"ddp": "DDPStrategy", "fsdp": "FSDPStrategy", "model_parallel": "ModelParallelStrategy",
                      "deepspeed_stage_2": "DeepSpeedStrategy", "deepspeed_stage_3": "DeepSpeedStrategy"}
    for cell in cells:
        name, _, precision = cell.split(",")
        zero, one = (job.reports[rank].get(cell) for rank in (0, 1))
        assert zero is not None and one is not None, f"{cell}: a rank did not report\n{job.output[-4000:]}"
        errors = [report["error"] for report in (zero, one) if "error" in report]
        assert not errors, f"{cell} failed: {errors}\n{job.output[-6000:]}"
        assert zero["strategy"] == one["strategy"] == {
            "class": expected_class[name], "precision": precision, "world": 2,
            "mesh": [1, 2] if name == "model_parallel" else None,
        }, cell
        losses = zero["losses"]
        assert losses and all(math.isfinite(v) for v in losses), f"{cell}: losses {losses}"
        assert one["losses"] == losses, f"{cell}: losses differ across ranks: {losses} vs {one['losses']}"
        assert one["params"] == zero["params"], f"{cell}: parameters differ across ranks after training"
        assert all(math.isfinite(v) for v in zero["params"]), cell
        for report in (zero, one):
            assert report["restored_equal"], f"{cell}: the load did not restore the saved parameters exactly"
        if launch == "trainer":
            # 24 samples in batches of 4 per data-parallel replica; the resumed fit had nothing left to do
            assert zero["steps"] == one["resumed_steps"] == (6 if name == "model_parallel" else 3), cell
            for report in (zero, one):
                assert report["revalidate"] == report["validate"] == zero["validate"], cell
            weights = [report["weights_only"] for report in (zero, one)]
            errors = [w["error"] for w in weights if "error" in w]
            assert not errors, f"{cell}: validate(ckpt_path=...) failed: {errors}"
            assert all(w["equal"] and w["validate"] == zero["validate"] for w in weights), f"{cell}: {weights}"
            continue
        assert zero["shards"] == ({"num_replicas": 1, "rank": 0} if name == "model_parallel"
                                  else {"num_replicas": 2, "rank": 0}), cell
        for report in (zero, one):
            assert report["step"] == 3, cell
            # the optimizer state came back too: the two steps after the load repeat those after the save
            assert report["resumed"] == report["continued"], f"{cell}: {report['resumed']} != {report['continued']}"
        if precision == "32-true":  # the same run as one process on the concatenated data-parallel batches
            assert zero["ref_error"] < 1e-5 and one["ref_error"] < 1e-5, f"{cell}: {zero['ref_error']}"
            assert losses == pytest.approx(zero["ref_losses"], rel=1e-5, abs=1e-6), cell


def _run(tmp_path: Path, launch: str, cells: list[str], timeout: float) -> None:
    """Run the cells that can run here in one job; cells that cannot (a backend missing) are named in a
    skip once the others passed, so a missing DeepSpeed never hides the FSDP cells of the same job."""
    missing = [f"{cell} ({_missing(cell)})" for cell in cells if _missing(cell)]
    cells = [cell for cell in cells if not _missing(cell)]
    if not cells:
        pytest.skip("not run: " + "; ".join(missing))
    job = run_job(JOB, tmp_path, args=(launch, *cells), command=_command(launch), timeout=timeout).check()
    _check(job, launch, cells)
    if missing:
        pytest.skip(f"{len(cells)} cells passed; not run: " + "; ".join(missing))


# ------------------------------------------------------------------------------------------- the tiers
# CI: one job per launch path. Together every strategy in both forms, every launch path with both forms
# and both precisions. DeepSpeed's first cell in a process costs ~5-9 s (import, engine), so all four
# DeepSpeed cells share one job: launch(fn), where the objects are pickled. The regression (an FSDP or a
# ModelParallel object through launch(fn); their lambdas sat in __init__ and in bf16-mixed's plugin) is here.
CI_CELLS: dict[str, list[str]] = {
    "launch": ["ddp,obj,bf16-mixed", "fsdp,str,32-true", "model_parallel,str,bf16-mixed"],
    "launch_fn": ["fsdp,obj,bf16-mixed", "model_parallel,obj,bf16-mixed",
                  "deepspeed_stage_2,obj,32-true", "deepspeed_stage_3,obj,bf16-mixed",
                  "deepspeed_stage_2,str,bf16-mixed", "deepspeed_stage_3,str,32-true"],
    "cli": ["ddp,str,32-true", "fsdp,obj,bf16-mixed"],
    "torchrun": ["model_parallel,obj,32-true", "ddp,str,bf16-mixed"],
    "trainer": ["model_parallel,obj,bf16-mixed", "fsdp,str,32-true"],
}


def _all_cells() -> list[str]:
    return [f"{s},{f},{p}" for s in STRATEGIES for f in FORMS for p in PRECISIONS]


def _slow_groups() -> list[Any]:
    """The rest of the matrix: per launch path, one job for the torch strategies and one for DeepSpeed
    (a missing DeepSpeed skips only that one)."""
    params = []
    for launch in LAUNCHES:
        rest = [cell for cell in _all_cells() if cell not in CI_CELLS[launch]]
        for family, deepspeed in (("torch", False), ("deepspeed", True)):
            cells = [cell for cell in rest if cell.startswith("deepspeed") == deepspeed]
            if cells:
                params.append(pytest.param(launch, cells, id=f"{launch}-{family}"))
    return params


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_launch_path_ci_cells(tmp_path: Path, launch: str) -> None:
    _run(tmp_path, launch, CI_CELLS[launch], timeout=220)


@pytest.mark.slow
@pytest.mark.skipif(not RUN_ALL, reason="the full launch matrix runs with PHALANX_TEST_ALL=1")
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("launch", "cells"), _slow_groups())
def test_launch_path_full_matrix(tmp_path: Path, launch: str, cells: list[str]) -> None:
    _run(tmp_path, launch, cells, timeout=400)


def test_the_tiers_cover_the_matrix() -> None:
    """CI: every strategy in both forms; every launch path with both forms and both precisions. CI and slow
    together: the whole matrix on every launch path, each cell once."""
    assert set(CI_CELLS) == set(LAUNCHES)
    ci = [cell.split(",") for group in CI_CELLS.values() for cell in group]
    assert {(name, form) for name, form, _ in ci} == {(s, f) for s in STRATEGIES for f in FORMS}
    for launch, group in CI_CELLS.items():
        assert {cell.split(",")[1] for cell in group} == set(FORMS), launch
        assert {cell.split(",")[2] for cell in group} == set(PRECISIONS), launch
    slow: dict[str, list[str]] = {launch: [] for launch in LAUNCHES}
    for param in _slow_groups():
        launch, cells = param.values
        slow[launch] += cells
    for launch in LAUNCHES:
        assert sorted(slow[launch] + CI_CELLS[launch]) == sorted(_all_cells()), launch
