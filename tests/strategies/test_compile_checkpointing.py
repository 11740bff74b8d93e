"""Activation checkpointing and torch.compile as options of every strategy (single, ddp, fsdp,
model_parallel): training with the option equals training without it, the option really acts
(blocks run forward twice under activation checkpointing), and compiling before setup is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOBS, SUPPORT, run_job

from phalanx import Fabric
from phalanx.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from phalanx.utils.errors import MisconfigurationError

pytestmark = pytest.mark.timeout(600)

JOB = JOBS / "compile_and_activation_checkpointing.py"
MODELS = SUPPORT / "compile_training.py"  # the ``models`` fixture (conftest.py); the jobs import it too


def _reference(models: dict[str, Any]) -> torch.Tensor:
    """The plain eager run with no option, one process."""
    fabric = Fabric(accelerator="cpu", devices=1)
    out = models["train"](fabric)
    assert out["block_calls"] == 8  # 2 blocks x 4 steps, forward only
    return torch.tensor(out["params"].tolist(), dtype=torch.float64)


def _check(got: Any, expected: torch.Tensor, atol: float) -> None:
    t = torch.tensor(got, dtype=torch.float64)
    assert torch.allclose(t, expected, atol=atol), (t - expected).abs().max()


def test_compile_before_setup_is_unwrapped_and_recompiled() -> None:
    # As in Lightning: the original module is set up, then compiled in place with the same settings
    # (tests/fabric/test_compiled.py covers the details).
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(torch.compile(torch.nn.Linear(2, 2), backend="eager"))
    assert list(model.state_dict()) == ["weight", "bias"]
    assert model.forward_module._compiled_call_impl is not None


def test_options_are_validated() -> None:
    for make in (SingleDeviceStrategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy):
        with pytest.raises(MisconfigurationError, match=r"compile must be True, False or a dict of torch\.compile"):
            make(compile="yes")
    for make in (SingleDeviceStrategy, DDPStrategy):
        with pytest.raises(MisconfigurationError, match=r"activation_checkpointing_policy must be a set of nn\.Module"):
            make(activation_checkpointing_policy=lambda m: True)


def test_activation_checkpointing_single_device(models: dict[str, Any]) -> None:
    expected = _reference(models)
    models["calls"][0] = 0
    fabric = Fabric(accelerator="cpu", devices=1,
                    strategy=SingleDeviceStrategy(activation_checkpointing_policy={models["FeedForward"]}))
    out = models["train"](fabric)
    assert out["block_calls"] == 16  # every block's forward re-ran in backward
    _check(out["params"].tolist(), expected, atol=1e-6)


@pytest.mark.parametrize("kind", [
    pytest.param("ddp", marks=pytest.mark.slow),
    pytest.param("fsdp", marks=pytest.mark.slow),
    pytest.param("model_parallel", marks=pytest.mark.slow),
])
def test_activation_checkpointing_equivalence(tmp_path: Path, models: dict[str, Any], kind: str) -> None:
    expected = _reference(models)
    job = run_job(JOB, tmp_path, args=(kind, "ac"),
                  timeout=400).check()
    for rep in job.reports.values():
        assert rep["block_calls"] == 16 and not rep["compiled"]
        _check(rep["params"], expected, atol=1e-6)


@pytest.mark.slow
def test_compile_single_device(models: dict[str, Any]) -> None:
    expected = _reference(models)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=SingleDeviceStrategy(compile=True))
    out = models["train"](fabric)
    module = models["last"][0].module
    assert type(module).__name__ == "Net" and module._compiled_call_impl is not None  # compiled in place
    assert list(module.state_dict()) == list(models["make_model"]().state_dict())  # keys unchanged
    _check(out["params"].tolist(), expected, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp", "model_parallel"])
def test_compile_equivalence(tmp_path: Path, models: dict[str, Any], kind: str) -> None:
    expected = _reference(models)
    job = run_job(JOB, tmp_path, args=(kind, "compile"),
                  timeout=580).check()
    for rep in job.reports.values():
        assert rep["compiled"]  # the module forward runs through (DDP wrapper, FSDP root) is compiled
        _check(rep["params"], expected, atol=1e-5)
