"""One marker for "this test needs X": ``@run_if(fsdp=True)``, ``pytestmark = run_if(module="transformers")``,
``pytest.param("deepspeed", marks=run_if(deepspeed=True))``.

``run_if(...)`` returns a ``pytest.mark.skipif`` whose reason names everything that is missing here and
how to get it, so a skipped test says why in ``pytest -ra``. With no arguments, or when everything is
present, the mark never skips.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from phalanx.strategies import available_strategies
from phalanx.utils.compat import FSDP_ON_CPU

__all__ = ["cuda_devices", "has_executable", "has_module", "missing", "run_if", "torch_at_least"]


def has_module(name: str) -> bool:
    """Whether ``name`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing or half-installed
        return False


def torch_at_least(version: str) -> bool:
    return Version(Version(torch.__version__).base_version) >= Version(version)


def has_executable(name: str) -> bool:
    return shutil.which(name) is not None or Path(sys.executable).with_name(name).exists()


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing(
    *,
    fsdp: bool = False,
    deepspeed: bool = False,
    cuda: bool = False,
    min_gpus: int = 0,
    min_torch: str | None = None,
    module: str | Iterable[str] = (),
    strategy: str | Iterable[str] = (),
    executable: str | Iterable[str] = (),
) -> list[str]:
    """What of the requested conditions does not hold here, one phrase each (empty: all present)."""
    problems: list[str] = []
    strategies = available_strategies()
    names = [strategy] if isinstance(strategy, str) else list(strategy)
    if fsdp:
        names.insert(0, "fsdp")
    if deepspeed:
        if not has_module("deepspeed"):
            problems.append("DeepSpeed is not installed (pip install 'phalanx[deepspeed]')")
        names.append("deepspeed")
    for name in dict.fromkeys(names):
        if name not in strategies:
            problems.append(f"strategy {name!r} is not available in this build")
    if fsdp and not FSDP_ON_CPU:
        problems.append(f"FSDP2 on CPU needs torch >= 2.7 (this is {torch.__version__})")
    gpus = max(min_gpus, 1 if cuda else 0)
    if gpus and cuda_devices() < gpus:
        problems.append(f"needs {gpus} CUDA device{'s' if gpus > 1 else ''} ({cuda_devices()} present)")
    if min_torch is not None and not torch_at_least(min_torch):
        problems.append(f"needs torch >= {min_torch} (this is {torch.__version__})")
    for name in [module] if isinstance(module, str) else module:
        if not has_module(name):
            problems.append(f"{name} is not installed")
    for name in [executable] if isinstance(executable, str) else executable:
        if not has_executable(name):
            problems.append(f"no `{name}` on PATH or next to {sys.executable}")
    return problems


def run_if(
    *,
    fsdp: bool = False,
    deepspeed: bool = False,
    cuda: bool = False,
    min_gpus: int = 0,
    min_torch: str | None = None,
    module: str | Iterable[str] = (),
    strategy: str | Iterable[str] = (),
    executable: str | Iterable[str] = (),
) -> pytest.MarkDecorator:
    """Skip unless every requested condition holds.

    fsdp: the ``fsdp`` strategy is registered and FSDP2 runs on CPU/gloo (torch >= 2.7), as the suite runs it.
    deepspeed: DeepSpeed is installed and the ``deepspeed`` strategy is registered.
    cuda / min_gpus: at least one / ``min_gpus`` CUDA devices.
    min_torch: torch's release is at least this (``"2.7"``; local tags such as ``+cpu`` are ignored).
    module: importable module name(s) (``"transformers"``, ``("mlflow", "wandb")``).
    strategy: registered strategy name(s) (``phalanx.strategies.available_strategies()``).
    executable: program(s) on PATH or in the running interpreter's bin dir (an unactivated venv).
    """
    problems = missing(fsdp=fsdp, deepspeed=deepspeed, cuda=cuda, min_gpus=min_gpus, min_torch=min_torch,
                       module=module, strategy=strategy, executable=executable)
    return pytest.mark.skipif(bool(problems), reason="; ".join(problems) or "every condition holds")
