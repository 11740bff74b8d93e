"""ModelParallelStrategy (tensor parallel x FSDP on a 2-D mesh): 4-rank jobs on gloo equal one process
on the concatenated data-parallel batches (Fabric and Trainer), data split by data-parallel rank,
clipping over both mesh dimensions, accumulation, and checkpoints resharded to other mesh shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOBS, SUPPORT, run_job

from phalanx import Fabric
from phalanx.strategies import ModelParallelStrategy, resolve_strategy
from phalanx.strategies.model_parallel import resolve_mesh_shape
from phalanx.utils.errors import MisconfigurationError

pytestmark = pytest.mark.timeout(400)

MODELS = SUPPORT / "model_parallel_models.py"  # the ``models`` fixture (conftest.py); the jobs import it too


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


def test_not_an_fsdp_strategy_as_in_lightning() -> None:
    # LitGPT's load_checkpoint takes its FSDP branch on isinstance(strategy, FSDPStrategy): a LoRA job under
    # ModelParallelStrategy must not. The code is shared through the base class instead.
    from phalanx.strategies import FSDPStrategy
    from phalanx.strategies.fsdp.strategy import ShardedStrategy

    strategy = ModelParallelStrategy()
    assert not isinstance(strategy, FSDPStrategy) and isinstance(strategy, ShardedStrategy)
    assert not issubclass(FSDPStrategy, ModelParallelStrategy)
    assert (strategy.name, FSDPStrategy().name) == ("model_parallel", "fsdp")
    with pytest.raises(MisconfigurationError, match=r"^ModelParallelStrategy takes no limit_all_gathers \(FSDP"):
        ModelParallelStrategy(limit_all_gathers=True)


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
EQUIVALENCE_JOB = JOBS / "model_parallel_equivalence.py"


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


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    """One 4-rank 2 x 2 job: training phases, a data-split probe, and the checkpoints it saved."""
    tmp_path = tmp_path_factory.mktemp("mp2x2")
    return tmp_path, run_job(EQUIVALENCE_JOB, tmp_path, timeout=300).check().reports


def test_two_by_two_training_equals_single_process(trained: tuple[Path, dict[int, dict[str, Any]]],
                                                   models: dict[str, Any]) -> None:
    reports = trained[1]
    expected_a, expected_norms = _reference(models, "adam", clip=True)
    expected_b, _ = _reference(models, "sgd", clip=False)
    assert max(expected_norms) > 0.5  # clipping really happened
    seen = {}
    for rank in range(4):
        rep = reports[rank]
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


TRAINER_JOB = JOBS / "model_parallel_trainer.py"


@pytest.mark.slow
def test_two_by_two_trainer_fit_equals_single_process(tmp_path: Path, models: dict[str, Any]) -> None:
    job = run_job(TRAINER_JOB, tmp_path, timeout=300).check()
    from torch.utils.data import DataLoader, TensorDataset

    import phalanx

    phalanx.seed_everything(7)
    trainer = phalanx.Trainer(accelerator="cpu", devices=1, max_epochs=2, enable_progress_bar=False,
                              enable_checkpointing=False, logger=False)
    model = models["LitNet"]()
    x, y = models["make_data"]()
    # One process, batches of 8 = the two data-parallel ranks' batches of 4, in the same order.
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True),
                DataLoader(TensorDataset(x[:20], y[:20]), batch_size=8))
    single = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert single["train_samples"] == 32 and single["val_samples"] == 20
    for rank in range(4):
        rep = job.reports[rank]
        assert rep["steps"] == trainer.global_step == 8
        _close(rep["params"], models["full_params"](model.net))
        # Every sample counted once: the tensor-parallel peers' identical logs are not added twice.
        assert rep["metrics"] == pytest.approx(single, rel=1e-6)


LOAD_JOB = JOBS / "model_parallel_load.py"


@pytest.mark.parametrize("shape", [
    pytest.param((1, 2), marks=pytest.mark.slow), pytest.param((2, 1), marks=pytest.mark.slow), (1, 1),
], ids=["1x2", "2x1", "1-process"])
def test_two_by_two_checkpoint_loads_on_other_meshes(trained: tuple[Path, dict[int, dict[str, Any]]],
                                                     tmp_path: Path, shape: tuple[int, int]) -> None:
    saved, reports = trained
    job = run_job(LOAD_JOB, tmp_path, args=(str(saved), *map(str, shape)), timeout=300).check()
    ref = reports[0]
    for rank in range(shape[0] * shape[1]):
        rep = job.reports[rank]
        for name in ("ckpt", "ckpt.pt"):
            _close(rep[name], torch.tensor(ref["a"], dtype=torch.float64), atol=1e-7)
            _close(rep[name + ":opt"], torch.tensor(ref["a_opt"], dtype=torch.float64), atol=1e-7)
            assert rep[name + ":step"] == 4
            # Training continues exactly as the 2 x 2 run did.
            _close(rep[name + ":after"], torch.tensor(ref["a_after"], dtype=torch.float64))


def test_misuse_is_refused_with_the_fix(trained: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    for rep in trained[1].values():
        assert rep["no_fn"].startswith("ModelParallelStrategy has no parallelize_fn and Net is not parallelized.")
        assert "parallelize_fn must modify the module in place" in rep["returns_other"]
        assert "returned a different object (OptimizedModule)" in rep["returns_other"]
        assert rep["not_data_parallel"].startswith("Parameters ['inp.weight', 'inp.bias', ")
        assert "are not sharded over the 'data_parallel' mesh dimension" in rep["not_data_parallel"]
        assert "inp.weight is distributed over a device mesh with dimensions None" in rep["foreign_mesh"]


def test_two_by_two_checkpoint_loads_without_a_process_group(trained: tuple[Path, dict[int, dict[str, Any]]],
                                                             models: dict[str, Any]) -> None:
    from phalanx.checkpoint import read_everything

    saved, reports = trained
    expected = torch.tensor(reports[0]["a"], dtype=torch.float64)
    fabric = Fabric(accelerator="cpu", devices=1)  # the single-device strategy: plain tensors
    model = fabric.setup(models["make_model"]())
    state: dict[str, Any] = {"model": model, "step": 0}
    fabric.load(saved / "ckpt.pt", state, strict=False)
    _close(models["full_params"](model).tolist(), expected, atol=1e-7)
    assert state["step"] == 4
    # The sharded directory reads as full tensors anywhere (what `phalanx consolidate` writes).
    plain = models["make_model"]()
    plain.load_state_dict(read_everything(saved / "ckpt")["model"])
    _close(models["full_params"](plain).tolist(), expected, atol=1e-7)


# ---------------------------------------------------------------------- meta-device init
MEMORY_JOB = JOBS / "model_parallel_memory.py"


@pytest.mark.slow
def test_meta_init_materializes_only_local_shards(tmp_path: Path) -> None:
    # glibc raises its mmap threshold after each large free, then keeps freed blocks (FSDP's per-block
    # all-gather buffers) in the heap: RSS would count every block's buffers as if alive. A fixed threshold
    # makes RSS follow live memory.
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    meta = run_job(MEMORY_JOB, tmp_path, args=("meta",), timeout=400, env=env).check().reports
    full = meta[0]["full_mib"]
    assert 380 < full < 420  # ~100 M float32 parameters
    for rank in range(4):
        rep = meta[rank]
        assert rep["finite"]
        # Each rank holds a quarter of the parameters (2 x 2): setup stays far below the full model,
        # and a training step (its parameters and gradients + one block all-gathered) stays under it.
        assert rep["setup_mib"] < 0.4 * full, rep
        assert rep["step_mib"] < 0.9 * full, rep
    by_coord = {tuple(meta[r]["coords"]): meta[r]["local"] for r in range(4)}
    for dp in (0, 1):
        a, b = by_coord[(dp, 0)], by_coord[(dp, 1)]
        # Replicated over 'tensor_parallel' (a RowwiseParallel bias, the LayerNorm): equal on both peers.
        for name in ("blocks.0.down.bias", "blocks.0.norm.weight", "blocks.0.norm.bias"):
            assert a[name] == b[name], name
        # Tensor-parallel shards come from different random streams (no repeated rows).
        for name in ("blocks.0.up.weight", "blocks.0.down.weight"):
            assert a[name] != b[name], name
    # Without empty_init every rank first builds the whole model: the same measurement sees it.
    eager = run_job(MEMORY_JOB, tmp_path, args=("eager",), timeout=400, env=env).check().reports
    assert all(eager[rank]["setup_mib"] > 0.9 * full for rank in range(4))


PRECISION_JOB = JOBS / "model_parallel_precision.py"


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_precisions_train_with_tensor_parallel(tmp_path: Path, models: dict[str, Any], precision: str) -> None:
    job = run_job(PRECISION_JOB, tmp_path, args=(precision,), timeout=300).check()
    model = models["make_model"]()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = models["make_data"]()
    for i in range(0, 32, 8):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 8]), y[i : i + 8]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    expected = models["full_params"](model)
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["dtype"] == ("torch.bfloat16" if precision == "bf16-true" else "torch.float32")
        assert (rep["scaler"] is not None) == (precision == "16-mixed")
        got = torch.tensor(rep["params"], dtype=torch.float64)
        assert torch.isfinite(got).all()
        # Half-precision arithmetic: close to the float32 run, not equal.
        assert (got - expected).abs().max() < 0.05, (got - expected).abs().max()
    assert job.reports[0]["params"] == job.reports[1]["params"]


SNAPSHOT_JOB = JOBS / "model_parallel_snapshot.py"


@pytest.mark.slow  # CI: the snapshot tier under ddp and fsdp (tests/trainer/test_survival.py, test_snapshot_*)
def test_tensor_parallel_shards_round_trip_through_a_per_rank_snapshot(tmp_path: Path) -> None:
    # Each rank snapshots its own tensor-parallel shards (parameters and Adam state as DTensor shards), and
    # loading puts them back as DTensors with the live parameters' placements: training continues identically.
    job = run_job(SNAPSHOT_JOB, tmp_path, timeout=300).check()
    for rank in (0, 1):
        rep = job.reports[rank]
        # latest_checkpoint answers in the terms it was asked (a relative folder); save_snapshot, absolute.
        assert rep["ref"] == str(tmp_path / rep["latest"]) and rep["ref"].endswith("snapshot-step=000000002")
        assert rep["restored"] and rep["same_next"] and rep["step"] == 2
    assert not (tmp_path / "snapshots").exists()
