"""ModelParallelStrategy (tensor parallel x FSDP on a 2-D mesh): 4-rank jobs on gloo equal one process
on the concatenated data-parallel batches (Fabric and Trainer), data split by data-parallel rank,
clipping over both mesh dimensions, accumulation, and checkpoints resharded to other mesh shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from mp import run_job

from phalanx import Fabric
from phalanx.errors import MisconfigurationError
from phalanx.strategies import ModelParallelStrategy, resolve_strategy
from phalanx.strategies.model_parallel import resolve_mesh_shape

pytestmark = pytest.mark.timeout(400)

# Shared by the jobs (imported as `models`) and the single-process references.
MODEL_CODE = '''
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class FeedForward(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([FeedForward(), FeedForward()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def parallelize(model, mesh):
    """Megatron-style MLP split over 'tensor_parallel', each block and the root sharded over 'data_parallel'."""
    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def make_model():
    torch.manual_seed(0)
    return Net()


def make_data(n=32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().reshape(-1).double().cpu()


def full_params(model):
    return torch.cat([full(p) for p in model.parameters()])
'''


@pytest.fixture()
def models(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "models.py").write_text(MODEL_CODE)
    namespace: dict[str, Any] = {}
    exec(MODEL_CODE, namespace)
    return namespace


def _close(got: list[float], expected: torch.Tensor, atol: float = 1e-6) -> None:
    t = torch.tensor(got, dtype=torch.float64)
    assert t.shape == expected.shape
    assert torch.allclose(t, expected, atol=atol), (t - expected).abs().max()


# ---------------------------------------------------------------------- no processes needed
def test_registered_name_and_lightning_constructor() -> None:
    assert isinstance(resolve_strategy("model_parallel", 4), ModelParallelStrategy)
    # Lightning's positional order, so a port is an import change.
    strategy = ModelParallelStrategy(lambda m, mesh: m, 2, 2, False, "gloo", 60.0)
    assert strategy.state_dict_type == "full" and strategy.backend == "gloo" and strategy.timeout == 60.0
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    assert fabric.strategy is strategy
    assert (strategy.data_parallel_size, strategy.tensor_parallel_size) == (2, 2)


@pytest.mark.parametrize(("dp", "tp", "devices", "nodes", "expected"), [
    ("auto", "auto", 4, 1, (1, 4)),  # tensor parallel within the node
    ("auto", "auto", 2, 3, (3, 2)),  # data parallel across nodes
    (2, "auto", 4, 1, (2, 2)),
    ("auto", 1, 4, 1, (4, 1)),
    (2, 2, 4, 1, (2, 2)),
])
def test_mesh_shape(dp: Any, tp: Any, devices: int, nodes: int, expected: tuple[int, int]) -> None:
    assert resolve_mesh_shape(dp, tp, devices, nodes) == expected


def test_mesh_shape_refused() -> None:
    with pytest.raises(MisconfigurationError, match=r"does not match the 4 processes .* their product must be 4"):
        Fabric(accelerator="cpu", devices=4, strategy=ModelParallelStrategy(data_parallel_size=3))
    with pytest.raises(MisconfigurationError, match="tensor_parallel_size must be a positive int or 'auto', got 0"):
        ModelParallelStrategy(tensor_parallel_size=0)
    with pytest.raises(MisconfigurationError, match="cannot be combined with save_distributed_checkpoint=False"):
        ModelParallelStrategy(save_distributed_checkpoint=False, async_save=True)


def test_sampler_kwargs_are_data_parallel_before_launch() -> None:
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    Fabric(accelerator="cpu", devices=4, strategy=strategy)
    strategy._world_size, strategy._rank = 4, 3  # what setup_environment sets on rank 3
    assert strategy.distributed_sampler_kwargs() == {"num_replicas": 2, "rank": 1}


# ---------------------------------------------------------------------- 4 ranks, 2 x 2
EQUIVALENCE_JOB = """
import torch
import phalanx
from torch.utils.data import DataLoader, TensorDataset
from phalanx.errors import GradientSyncError
from phalanx.strategies import ModelParallelStrategy
from mp import report
from models import make_model, make_data, full_params, parallelize

torch.set_num_threads(1)
fabric = phalanx.Fabric(accelerator="cpu", devices=4, strategy=ModelParallelStrategy(parallelize, 2, 2))
fabric.launch()
mesh = fabric.strategy.device_mesh
dp = mesh["data_parallel"].get_local_rank()
x, y = make_data()
ce = torch.nn.functional.cross_entropy

# Data: tensor-parallel peers read the same samples, data-parallel ranks different ones.
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(16)), batch_size=2, shuffle=True))
report(fabric, coords=mesh.get_coordinate(), seen=[int(i) for (b,) in loader for i in b],
       sampler=fabric.strategy.distributed_sampler_kwargs())

# A: Adam + clipping by the global norm (over both mesh dimensions), optimizer built before setup.
model2 = make_model()
model, opt = fabric.setup(model2, torch.optim.Adam(model2.parameters(), lr=0.01))
norms = []
for i in range(0, 32, 8):
    opt.zero_grad()
    lo = i + 4 * dp
    fabric.backward(ce(model(x[lo : lo + 4]), y[lo : lo + 4]))
    norms.append(fabric.clip_gradients(model, opt, max_norm=0.5).item())
    opt.step()
report(fabric, a=full_params(model), a_norms=norms)

# B: gradient accumulation (2 micro-batches per step); the first skips the data-parallel reduce.
model = fabric.setup_module(make_model())
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
skipped = []
for i in range(0, 32, 8):
    opt.zero_grad()
    for j, micro in enumerate((0, 2)):
        lo = i + 4 * dp + micro
        with fabric.no_backward_sync(model, enabled=j == 0):
            fabric.backward(ce(model(x[lo : lo + 2]), y[lo : lo + 2]) / 2)
        if j == 0:
            skipped.append(all(p.grad is None for p in model.parameters()))
    opt.step()
report(fabric, b=full_params(model), skipped=skipped)

# Stepping after a backward that skipped the reduce must raise (as under FSDP and DDP).
with fabric.no_backward_sync(model):
    fabric.backward(ce(model(x[:4]), y[:4]))
try:
    opt.step()
    report(fabric, step_error=None)
except GradientSyncError as err:
    report(fabric, step_error=str(err))
"""


def _reference(models: dict[str, Any], opt_name: str, clip: bool, steps: int = 4) -> tuple[torch.Tensor, list[float]]:
    model = models["make_model"]()
    x, y = models["make_data"]()
    if opt_name == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for i in range(0, 8 * steps, 8):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 8]), y[i : i + 8]).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
    return models["full_params"](model), norms


def test_two_by_two_training_equals_single_process(tmp_path: Path, models: dict[str, Any]) -> None:
    job = run_job(EQUIVALENCE_JOB, tmp_path, timeout=300).check()
    expected_a, expected_norms = _reference(models, "adam", clip=True)
    expected_b, _ = _reference(models, "sgd", clip=False)
    assert max(expected_norms) > 0.5  # clipping really happened
    seen = {}
    for rank in range(4):
        rep = job.reports[rank]
        dp, tp = rep["coords"]
        assert rep["sampler"] == {"num_replicas": 2, "rank": dp}
        seen[(dp, tp)] = rep["seen"]
        _close(rep["a"], expected_a)
        # A replicated shard counted once per replica would inflate the norm (by up to sqrt(2) here).
        assert rep["a_norms"] == pytest.approx(expected_norms, rel=1e-5)
        _close(rep["b"], expected_b)
        assert rep["skipped"] == [True] * 4
        assert "optimizer.step() was called while the gradients of Net were never reduce-scattered" in (
            rep["step_error"] or ""
        )
    # The classic silent bug: split by world rank, the two tensor-parallel peers would read different data.
    assert seen[(0, 0)] == seen[(0, 1)] and seen[(1, 0)] == seen[(1, 1)]
    assert sorted(seen[(0, 0)] + seen[(1, 0)]) == list(range(16))
