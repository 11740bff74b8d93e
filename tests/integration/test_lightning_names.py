"""Every Lightning name LitGPT 0.5.13 imports has a phalanx path with the same tail, and works (or refuses,
saying what to use instead)."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from job_runner import JOB_PYTHONPATH
from torch import nn

from phalanx.utils.errors import CheckpointError, MisconfigurationError

# Lightning path -> phalanx path, name (the import lines of LitGPT with the package swapped).
NAMES = [
    ("lightning.fabric.accelerators", "phalanx.accelerators", "CUDAAccelerator"),
    ("lightning.fabric.plugins", "phalanx.plugins", "BitsandbytesPrecision"),
    ("lightning.fabric.utilities", "phalanx.utilities", "ThroughputMonitor"),
    ("lightning.fabric.utilities", "phalanx.utilities", "rank_zero_only"),
    ("lightning.fabric.utilities.throughput", "phalanx.utilities.throughput", "ThroughputMonitor"),
    ("lightning.fabric.utilities.throughput", "phalanx.utilities.throughput", "measure_flops"),
    ("lightning.fabric.utilities.load", "phalanx.utilities.load", "_lazy_load"),
    ("lightning.fabric.utilities.load", "phalanx.utilities.load", "_NotYetLoadedTensor"),
    ("lightning.fabric.utilities.init", "phalanx.utilities.init", "_materialize_meta_tensors"),
    ("lightning.fabric.utilities.testing", "phalanx.utilities.testing", "_runif_reasons"),
    ("lightning.fabric.loggers", "phalanx.loggers", "CSVLogger"),
    ("lightning.fabric.loggers", "phalanx.loggers", "TensorBoardLogger"),
    ("lightning.fabric.strategies", "phalanx.strategies", "FSDPStrategy"),
    ("lightning.fabric.strategies", "phalanx.strategies", "ModelParallelStrategy"),
    ("lightning.pytorch.loggers", "phalanx.loggers", "LitLogger"),
    ("lightning.pytorch.loggers", "phalanx.loggers", "MLFlowLogger"),
    ("lightning.pytorch.loggers", "phalanx.loggers", "WandbLogger"),
    ("lightning.pytorch.cli", "phalanx.cli", "instantiate_class"),
    ("lightning", "phalanx", "LightningDataModule"),
]


def test_every_name_imports_in_a_fresh_interpreter() -> None:
    lines = [f"from {module} import {name}" for _, module, name in NAMES]
    touch = "L.Fabric, L.accelerators.CUDAAccelerator, L.plugins"
    script = "\n".join([*lines, "import phalanx as L", touch, "print('ok')"])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": JOB_PYTHONPATH, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# What each name must be for LitGPT's calls to work: a class or a function, and the parameters LitGPT passes, in
# Lightning's order (positional) or by Lightning's names (keyword).
CLASS, FUNCTION = "class", "function"
SHAPES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "CUDAAccelerator": (CLASS, (), ()),
    "BitsandbytesPrecision": (CLASS, ("mode", "dtype"), ("ignore_modules",)),
    "ThroughputMonitor": (CLASS, ("fabric",), ()),
    "rank_zero_only": (FUNCTION, ("fn",), ()),
    "measure_flops": (FUNCTION, ("model", "forward_fn", "loss_fn"), ()),
    "_lazy_load": (FUNCTION, ("path",), ()),
    "_NotYetLoadedTensor": (CLASS, (), ()),
    "_materialize_meta_tensors": (FUNCTION, ("module", "device"), ()),
    "_runif_reasons": (FUNCTION, (), ("min_cuda_gpus", "min_torch", "bf16_cuda")),
    "CSVLogger": (CLASS, ("root_dir", "name", "version"), ()),
    "TensorBoardLogger": (CLASS, ("root_dir", "name", "version"), ()),
    "FSDPStrategy": (CLASS, (), ("auto_wrap_policy", "activation_checkpointing_policy", "state_dict_type",
                                 "sharding_strategy", "cpu_offload")),
    "ModelParallelStrategy": (CLASS, ("parallelize_fn", "data_parallel_size", "tensor_parallel_size"), ()),
    "LitLogger": (CLASS, (), ()),
    "MLFlowLogger": (CLASS, ("experiment_name", "run_name", "tracking_uri"), ()),
    "WandbLogger": (CLASS, ("name", "save_dir", "version"), ("project",)),
    "instantiate_class": (FUNCTION, ("args", "init"), ()),
    "LightningDataModule": (CLASS, (), ()),
}


@pytest.mark.parametrize(("lightning", "module", "name"), NAMES)
def test_name(lightning: str, module: str, name: str) -> None:
    """The name is what LitGPT uses it as: a class or a function taking the parameters LitGPT passes."""
    obj = getattr(importlib.import_module(module), name)
    kind, positional, keywords = SHAPES[name]
    assert (inspect.isclass(obj) if kind == CLASS else inspect.isfunction(obj)), (name, obj)
    parameters = inspect.signature(obj).parameters
    assert list(parameters)[: len(positional)] == list(positional), (name, list(parameters))
    assert set(keywords) <= set(parameters), (name, list(parameters))
    # Each name has one phalanx object, whatever path it is imported from.
    assert all(getattr(importlib.import_module(m), n) is obj for _, m, n in NAMES if n == name)


def test_lightning_names_are_phalanx_own_types() -> None:
    import phalanx
    from phalanx.accelerators import Accelerator, CUDAAccelerator
    from phalanx.strategies import FSDPStrategy, ModelParallelStrategy, Strategy

    assert issubclass(CUDAAccelerator, Accelerator)
    assert issubclass(FSDPStrategy, Strategy) and issubclass(ModelParallelStrategy, Strategy)
    assert phalanx.LightningDataModule is phalanx.DataModule


def test_cuda_accelerator_answers() -> None:
    from phalanx import Fabric
    from phalanx.accelerators import CPUAccelerator, CUDAAccelerator

    assert CUDAAccelerator.auto_device_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert CUDAAccelerator.is_available() == torch.cuda.is_available()
    assert CPUAccelerator.auto_device_count() == 1
    fabric = Fabric(accelerator=CPUAccelerator(), devices=1)
    assert fabric.device == torch.device("cpu") and isinstance(fabric.accelerator, CPUAccelerator)


def test_bitsandbytes_precision_refuses_with_the_alternative() -> None:
    from phalanx.plugins import BitsandbytesPrecision

    with pytest.raises(MisconfigurationError, match=r"BitsandbytesPrecision\(mode='nf4'\) is not supported.*"
                                                     r"precision='bf16-true'"):
        BitsandbytesPrecision("nf4", torch.bfloat16)


def test_lazy_load_reads_tensors_only_when_used(tmp_path: Path) -> None:
    from phalanx.utilities.load import _lazy_load, _NotYetLoadedTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    path = tmp_path / "model.pth"
    torch.save({"model": model.state_dict(), "step": 12}, path)
    loaded = _lazy_load(path)
    assert loaded["step"] == 12
    weight = loaded["model"]["0.weight"]
    assert isinstance(weight, _NotYetLoadedTensor)
    assert weight.shape == (3, 4) and weight.dtype == torch.float32 and "0.weight" in repr(weight)
    fresh = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    fresh.load_state_dict(loaded["model"])  # materialised one by one, through torch functions
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(weight._load_tensor(), model[0].weight)
    assert weight.to(torch.float16).dtype == torch.float16  # tensor methods work on the loaded tensor
    assert torch.equal(torch.cat([loaded["model"]["0.bias"]] * 2), torch.cat([model[0].bias.detach()] * 2))


def test_lazy_load_never_runs_code(tmp_path: Path) -> None:
    from phalanx.utilities.load import _lazy_load

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("code ran",))

    path = tmp_path / "evil.pth"
    torch.save({"x": Payload()}, path)
    with pytest.raises(Exception, match=r"Weights only load failed|weights_only"):
        _lazy_load(path)


def test_lazy_load_refuses_legacy_files_with_the_fix(tmp_path: Path) -> None:
    from phalanx.utilities.load import _lazy_load

    path = tmp_path / "old.pth"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match=r"legacy.*save it again with torch\.save"):
        _lazy_load(path)


def test_runif_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.utilities.testing import _runif_reasons

    assert _runif_reasons() == ([], {})
    reasons, _ = _runif_reasons(min_cuda_gpus=99, min_torch="99.0", min_python="3.0")
    assert reasons == ["GPUs>=99", "torch>=99.0"]
    assert _runif_reasons(max_torch="1.0")[0] == ["torch<1.0"]
    monkeypatch.delenv("PHALANX_RUN_STANDALONE_TESTS", raising=False)
    monkeypatch.delenv("PL_RUN_STANDALONE_TESTS", raising=False)
    reasons, kwargs = _runif_reasons(standalone=True)
    assert kwargs == {"standalone": True} and len(reasons) == 1
    monkeypatch.setenv("PL_RUN_STANDALONE_TESTS", "1")
    assert _runif_reasons(standalone=True)[0] == []


def test_materialize_meta_tensors_under_lightning_name() -> None:
    from phalanx.utilities.init import _materialize_meta_tensors

    with torch.device("meta"):
        model = nn.Linear(2, 2)
    _materialize_meta_tensors(model, torch.device("cpu"))
    assert model.weight.device.type == "cpu" and torch.isfinite(model.weight).all()


def test_instantiate_class_builds_an_optimizer_as_litgpt_does() -> None:
    from phalanx.cli import instantiate_class

    model = nn.Linear(2, 2)
    optimizer = instantiate_class(model.parameters(), {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.5}})
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == 0.5
