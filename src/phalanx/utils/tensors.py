"""Small helpers shared across phalanx (no process state lives here)."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from phalanx.utils.errors import MisconfigurationError


def apply_to_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in a nested structure of dicts, lists, tuples, named tuples and
    dataclasses, returning a structure of the same shape."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if type(data) is tuple or type(data) is list:  # the usual batch; checked before the (slow) ABC check
        return type(data)(apply_to_tensors(v, fn) for v in data)
    if isinstance(data, Mapping):
        return type(data)({k: apply_to_tensors(v, fn) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # named tuple
        return type(data)(*(apply_to_tensors(v, fn) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(apply_to_tensors(v, fn) for v in data)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changes = {f.name: apply_to_tensors(getattr(data, f.name), fn) for f in dataclasses.fields(data)}
        return dataclasses.replace(data, **changes)
    return data


def move_to_device(data: Any, device: torch.device) -> Any:
    # Called on every batch: the usual shapes (a tensor, a tuple/list of tensors) take a direct path, and
    # a tensor already on the device (CPU jobs, loaders that pin and move) is returned as it is.
    if isinstance(data, torch.Tensor):
        return data if data.device == device else data.to(device, non_blocking=True)
    if type(data) is tuple or type(data) is list:
        return type(data)([
            v if isinstance(v, torch.Tensor) and v.device == device else move_to_device(v, device) for v in data
        ])
    return apply_to_tensors(data, lambda t: t if t.device == device else t.to(device, non_blocking=True))


def optional_module(name: str, who: str, extra: str, package: str | None = None) -> Any:
    """Import an optional dependency on first use, or say which extra installs it (``package``: what
    is missing when it is not the module's top level, e.g. tensorboard behind torch.utils.tensorboard)."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        package = package or name.split(".")[0]
        raise MisconfigurationError(f"{who} needs {package}: pip install 'phalanx[{extra}]'.") from err


def is_metric(obj: Any) -> bool:
    """Whether ``obj`` is a torchmetrics ``Metric`` (False without importing torchmetrics: no object
    can be one unless the user's code imported it)."""
    tm = sys.modules.get("torchmetrics")
    return tm is not None and isinstance(obj, tm.Metric)
