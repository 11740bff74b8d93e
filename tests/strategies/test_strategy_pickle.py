"""Strategy objects travel to new processes: ``fabric.launch(fn)`` pickles the Fabric's arguments.

A lambda stored on a strategy (or on the precision plugin it selects) made ``Fabric(strategy=
FSDPStrategy(...)).launch(fn)`` die before any rank started, while the string form worked: these tests
pickle every public strategy class with each documented option after ``Fabric(...)`` configured it,
and run the failing combination for real.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOBS, run_job
from run_if import run_if
from torch import nn

import phalanx
from phalanx.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)


def shard_whole(module: nn.Module, mesh: Any) -> nn.Module:
    """A module-level parallelize_fn (a user's would be one too: lambdas cannot be sent to new processes)."""
    return module


def _configs() -> list[Any]:
    cases: list[Any] = [
        pytest.param(SingleDeviceStrategy, {}, 1, id="single"),
        pytest.param(SingleDeviceStrategy, {"activation_checkpointing_policy": {nn.Linear}, "compile": True}, 1,
                     id="single-transforms"),
        pytest.param(DDPStrategy, {}, 2, id="ddp"),
        pytest.param(DDPStrategy, {"find_unused_parameters": True, "broadcast_buffers": False,
                                   "gradient_as_bucket_view": True, "static_graph": True, "bucket_cap_mb": 5.0,
                                   "verify_sync": True, "timeout": 60.0, "guard_timeout": 5.0,
                                   "lockstep": "strict", "backend": "gloo"}, 2, id="ddp-options"),
    ]
    fsdp = run_if(fsdp=True)
    cases += [
        pytest.param(FSDPStrategy, {}, 2, id="fsdp", marks=fsdp),
        pytest.param(FSDPStrategy, {"auto_wrap_policy": {nn.Linear}, "reshard_after_forward": False,
                                    "cpu_offload": True, "activation_checkpointing_policy": {nn.Linear},
                                    "compile": {"dynamic": False}}, 2, id="fsdp-options", marks=fsdp),
        pytest.param(FSDPStrategy, {"parallelize_fn": shard_whole, "state_dict_type": "full"}, 2,
                     id="fsdp-parallelize-full", marks=fsdp),
        pytest.param(FSDPStrategy, {"async_save": True}, 2, id="fsdp-async", marks=fsdp),
        pytest.param(FSDPStrategy, {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 1)}, 2,
                     id="fsdp-hybrid", marks=fsdp),
        pytest.param(FSDPStrategy, {"sharding_strategy": "_HYBRID_SHARD_ZERO2"}, 2, id="fsdp-hybrid-zero2", marks=fsdp),
        pytest.param(FSDPStrategy, {"sharding_strategy": "SHARD_GRAD_OP", "reshard_after_forward": False}, 2,
                     id="fsdp-shard-grad-op", marks=fsdp),
        pytest.param(FSDPStrategy, {"sharding_strategy": "NO_SHARD"}, 2, id="fsdp-no-shard", marks=fsdp),
        pytest.param(FSDPStrategy, {"device_mesh": [1, 2]}, 2, id="fsdp-mesh-shape", marks=fsdp),
        pytest.param(FSDPStrategy, {"limit_all_gathers": True, "use_orig_params": True}, 2, id="fsdp-fsdp1-args",
                     marks=fsdp),
        pytest.param(FSDPStrategy, {"limit_all_gathers": False}, 2, id="fsdp-no-limit-all-gathers", marks=fsdp),
        pytest.param(ModelParallelStrategy, {}, 2, id="model_parallel", marks=fsdp),
        pytest.param(ModelParallelStrategy, {"parallelize_fn": shard_whole, "data_parallel_size": 1,
                                             "tensor_parallel_size": 2, "save_distributed_checkpoint": False},
                     2, id="model_parallel-options", marks=fsdp),
        pytest.param(ModelParallelStrategy, {"async_save": True}, 2, id="model_parallel-async", marks=fsdp),
    ]
    ds = run_if(deepspeed=True)
    for stage in (1, 2, 3):
        cases.append(pytest.param(DeepSpeedStrategy, {"stage": stage}, 2, id=f"deepspeed-{stage}", marks=ds))
    cases.append(pytest.param(DeepSpeedStrategy, {"stage": 3, "offload_optimizer": True, "offload_parameters": True,
                                                  "state_dict_type": "full"}, 2, id="deepspeed-offload", marks=ds))
    return cases


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize(("cls", "options", "devices"), _configs())
def test_every_strategy_pickles_after_fabric_selected_its_precision(
    cls: type, options: dict[str, Any], devices: int, precision: str
) -> None:
    strategy = cls(**options)
    try:
        fabric = phalanx.Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=precision)
    except phalanx.errors.MisconfigurationError as err:
        pytest.skip(f"not a supported combination on CPU: {err}")
    clone = pickle.loads(pickle.dumps(fabric.strategy))
    assert type(clone) is cls
    for name in ("sharding_strategy", "reshard_after_forward", "_mesh_shape", "limit_all_gathers", "use_orig_params"):
        assert getattr(clone, name, None) == getattr(fabric.strategy, name, None)
    assert type(clone.precision) is type(fabric.strategy.precision)


@pytest.mark.slow  # CI: tests/fabric/test_launch_matrix.py runs FSDP objects through launch(fn)
@run_if(fsdp=True)
@pytest.mark.timeout(200)
def test_fsdp_object_through_launch_fn_trains_and_round_trips(tmp_path: Path) -> None:
    job = run_job(
        JOBS / "strategy_pickle_fsdp_through_launch_fn.py",
        tmp_path,
        timeout=180,
    ).check()
    assert "result 0" in job.stdout
    assert job.reports[0]["losses"] == job.reports[1]["losses"]
    assert all(job.reports[rank]["same"] for rank in (0, 1))
    assert all(torch.isfinite(torch.tensor(job.reports[0]["losses"])))
