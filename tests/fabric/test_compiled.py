"""``fabric.setup(torch.compile(model))``: set up the original module, compiled again with the same settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOBS, run_job
from torch import nn

from phalanx import Fabric
from phalanx.strategies import SingleDeviceStrategy
from phalanx.utils.errors import MisconfigurationError

pytestmark = pytest.mark.timeout(240)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


def counting_backend(calls: list[int]) -> Any:
    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        calls.append(1)
        return gm.forward

    return backend


@pytest.mark.parametrize("how", ["setup", "setup_module"])
def test_compiled_module_is_set_up_and_recompiled(how: str) -> None:
    calls: list[int] = []
    model = Net()
    compiled = torch.compile(model, backend=counting_backend(calls))
    fabric = Fabric(accelerator="cpu", devices=1)
    if how == "setup":
        wrapped, _ = fabric.setup(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1))
    else:
        wrapped = fabric.setup_module(compiled)
    assert wrapped.module is model  # the original, not the OptimizedModule
    assert list(wrapped.state_dict()) == ["lin.weight", "lin.bias"]  # no "_orig_mod." prefix
    x = torch.randn(4, 3)
    out = wrapped(x)
    assert calls, "the set-up module did not run through the user's compile settings (their backend)"
    assert torch.allclose(out, model.lin(x).relu())


def test_compiled_twice_is_refused() -> None:
    fabric = Fabric(accelerator="cpu", strategy=SingleDeviceStrategy(compile=True), devices=1)
    with pytest.raises(MisconfigurationError, match=r"compiled twice.*Keep one"):
        fabric.setup(torch.compile(Net(), backend="eager"))


def test_strategy_without_compile_refuses_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    import phalanx.fabric.compiled as compiled_module

    monkeypatch.setattr(compiled_module, "_strategy_compiles", lambda strategy: False)
    with pytest.raises(MisconfigurationError, match=r"cannot compile the module it sets up.*without "
                                                     r"`model = torch.compile\(model\)`"):
        fabric.setup(torch.compile(Net(), backend="eager"))


JOB = JOBS / "compiled_setup.py"


def test_compiled_module_under_ddp(tmp_path: Path) -> None:
    job = run_job(JOB, tmp_path, timeout=240).check()
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["calls"] > 0 and rep["original"] and rep["keys"] == ["lin.weight", "lin.bias"]
    assert job.reports[0]["weight"] == job.reports[1]["weight"]  # gradients were averaged: replicas agree
