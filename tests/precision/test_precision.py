"""The precision contract (phalanx.precision.base): one class per precision in one table, a precision object kept
as it is by every strategy, and readers (MFU, anomaly checks, the CLI) asking the precision instead of its name."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from run_if import run_if
from torch import nn
from torch.optim import Optimizer

from phalanx import Fabric
from phalanx.fabric.throughput import get_available_flops, peak_flops
from phalanx.precision import (
    PRECISIONS,
    REGISTRY,
    Float8Precision,
    MixedPrecision,
    Placement,
    Precision,
    canonical_precision,
    resolve_precision,
)
from phalanx.strategies import DeepSpeedStrategy, ModelParallelStrategy
from phalanx.strategies.registry import BACKENDS
from phalanx.utils.errors import MisconfigurationError, PhalanxWarning

COMPUTE_DTYPES = {
    "32-true": torch.float32, "64-true": torch.float64, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16,
    "16-true": torch.float16, "bf16-true": torch.bfloat16, "fp8-mixed": torch.float8_e4m3fn,
}


class Counting(MixedPrecision):
    """A precision that adds behaviour to a registered one: every strategy must keep it."""

    def __init__(self) -> None:
        super().__init__("bf16-mixed")
        self.backwards = 0
        self.after_steps = 0

    def pre_backward(self, loss: torch.Tensor) -> torch.Tensor:
        self.backwards += 1
        return super().pre_backward(loss)

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        self.after_steps += 1


def test_one_table_names_every_precision() -> None:
    assert PRECISIONS == tuple(REGISTRY) == tuple(COMPUTE_DTYPES)
    for name, build in REGISTRY.items():
        precision = build()
        assert isinstance(precision, Precision) and precision.name == name
        assert precision.compute_dtype == COMPUTE_DTYPES[name]  # what MFU divides by
        assert canonical_precision(name) == name
    for backend in BACKENDS:
        assert set(backend.load().supported_precisions) <= set(REGISTRY), backend.attr


def test_names_aliases_and_refusals() -> None:
    assert canonical_precision(16) == "16-mixed" and canonical_precision("bf16") == "bf16-mixed"
    with pytest.raises(MisconfigurationError, match=r"Unknown precision 'fp4'. Choose one of '32-true'.*Precision"):
        resolve_precision("fp4")
    for lightning in ("transformer-engine", "transformer-engine-float16"):
        with pytest.raises(MisconfigurationError, match=r"not NVIDIA Transformer Engine.*precision='fp8-mixed'"):
            Fabric(accelerator="cpu", precision=lightning)
    with pytest.raises(MisconfigurationError, match=r"precision=\[1\]: pass a name"):
        resolve_precision([1])  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match=r"choose 'bf16-mixed' or '16-mixed'"):
        MixedPrecision("bf16-true")


def test_a_precision_object_is_used_as_given_and_keeps_what_it_adds() -> None:
    precision = Counting()
    fabric = Fabric(accelerator="cpu", precision=precision)
    assert fabric.strategy.precision is precision
    model = nn.Linear(4, 2)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        out = model(torch.randn(2, 4))
        assert out.dtype == torch.float32  # autocast inside, float32 handed back
        fabric.backward(out.square().mean())
        optimizer.step()
        optimizer.zero_grad()
    assert (precision.backwards, precision.after_steps) == (3, 3)
    assert fabric.strategy.precision.scales_loss is False
    assert not isinstance(precision.forward_context(), contextlib.nullcontext)


@run_if(fsdp=True)
def test_sharded_strategies_place_the_precision_instead_of_replacing_it() -> None:
    fsdp = Fabric(accelerator="cpu", devices=2, strategy="fsdp", precision=Counting())
    placed = fsdp.strategy.precision
    assert isinstance(placed, Counting) and placed.placement.sharded and placed.placement.fsdp_casts
    policy = placed.fsdp_policy()  # FSDP2 casts parameters itself: no autocast
    assert policy is not None and policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert isinstance(placed.forward_context(), contextlib.nullcontext)
    tp = Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(lambda m, mesh: m), precision=Counting())
    placed = tp.strategy.precision
    assert isinstance(placed, Counting) and placed.placement.sharded and placed.placement.tensor_parallel
    assert placed.fsdp_policy() is None  # parallelize_fn shards: autocast instead
    assert not isinstance(placed.forward_context(), contextlib.nullcontext)
    assert not Fabric(accelerator="cpu", devices=2, strategy="ddp", precision=Counting()).strategy.precision \
        .placement.sharded


def test_deepspeed_takes_registered_precisions_and_refuses_what_its_engine_would_skip() -> None:
    strategy = DeepSpeedStrategy()
    strategy.configure(device_type="cpu", devices=1, num_nodes=1, precision=MixedPrecision("bf16-mixed"))
    assert strategy.precision.name == "bf16-mixed" and strategy.precision.compute_dtype == torch.bfloat16
    with pytest.raises(MisconfigurationError, match=r"hooks of Counting would not run. Pass the precision by name"):
        DeepSpeedStrategy().configure(device_type="cpu", devices=1, num_nodes=1, precision=Counting())
    with pytest.raises(MisconfigurationError, match=r"'fp8-mixed' is not supported by strategy='deepspeed'"):
        DeepSpeedStrategy().configure(device_type="cpu", devices=1, num_nodes=1, precision=Float8Precision())


def test_the_launch_flag_keeps_an_object_of_its_name_and_replaces_another(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_PRECISION", "bf16-mixed")
    precision = Counting()
    assert Fabric(accelerator="cpu", precision=precision).strategy.precision is precision
    monkeypatch.setenv("PHALANX_PRECISION", "32-true")
    with pytest.warns(PhalanxWarning, match=r"sets precision=Counting\(name='bf16-mixed'\) but the job was launched "
                      r"with --precision 32-true; using 32-true"):
        assert Fabric(accelerator="cpu", precision=Counting()).strategy.precision.name == "32-true"


def test_mfu_divides_by_the_peak_of_the_precisions_compute_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")

    class Stub:  # what peak_flops reads of a Fabric
        device = torch.device("cuda", 0)

        def __init__(self, precision: Precision) -> None:
            self.strategy = type("S", (), {"precision": precision})()

    fabric: Any = Stub(REGISTRY["bf16-mixed"]())
    assert peak_flops(fabric) == 989.4e12
    fabric = Stub(Float8Precision())
    assert peak_flops(fabric) == 1978.9e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert get_available_flops(torch.device("cuda"), torch.float8_e4m3fn) is None  # no float8 units: no MFU


def test_loss_scaling_is_asked_of_the_precision() -> None:
    fabric = Fabric(accelerator="cpu", precision="16-mixed")
    assert fabric.strategy.precision.scales_loss
    with pytest.raises(MisconfigurationError, match=r"precision='16-mixed' scales the loss"):
        fabric.backward(nn.Linear(2, 1)(torch.ones(1, 2)).sum())
    assert not Fabric(accelerator="cpu", precision="bf16-mixed").strategy.precision.scales_loss


def test_placement_defaults_run_no_collective() -> None:
    placement = Placement()
    assert placement.device_type == "cpu" and not placement.sharded
    with placement.guarded("anything"):
        pass
