"""phalanx: PyTorch training from one CPU to many devices, correct by construction.

Heavy optional dependencies (tensorboard, matplotlib, deepspeed, rich, jsonargparse, mlflow, wandb)
are imported only when used, so ``import phalanx`` costs little more than ``import torch``.

Lightning code ports by changing its imports: ``import phalanx as L`` (or ``as pl``) gives
``L.LightningModule``, ``L.LightningDataModule``, ``L.Trainer``, ``L.Fabric``, ``L.Callback``,
``L.seed_everything``, and ``L.callbacks`` / ``L.loggers`` / ``L.profilers`` / ``L.tuner`` /
``L.utilities`` / ``L.cli``. Deliberate differences are listed in docs/porting.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx import _moved
from phalanx.fabric.fabric import Fabric
from phalanx.fabric.wrappers import is_wrapped
from phalanx.utils.errors import (
    CheckpointError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GradientSyncError,
    MisconfigurationError,
    PhalanxError,
    PhalanxWarning,
    RankGoneError,
)
from phalanx.utils.seed import seed_everything

__version__ = "0.1.0"

_moved.install()

if TYPE_CHECKING:
    from phalanx.callbacks import Callback
    from phalanx.cli.config import LightningCLI
    from phalanx.core import DataModule, Module
    from phalanx.trainer import Trainer

    LightningModule = Module
    LightningDataModule = DataModule

# name -> (module, attribute); imported on first use so `import phalanx` stays light.
_LAZY = {
    "Trainer": ("phalanx.trainer", "Trainer"),
    "Module": ("phalanx.core", "Module"),
    "DataModule": ("phalanx.core", "DataModule"),
    "LightningModule": ("phalanx.core", "Module"),
    "LightningDataModule": ("phalanx.core", "DataModule"),
    "Callback": ("phalanx.callbacks", "Callback"),
    "LightningCLI": ("phalanx.cli.config", "LightningCLI"),
}
_SUBMODULES = ("callbacks", "loggers", "profilers", "tuner", "utilities", "cli", "strategies", "trainer",
               "data", "checkpoint", "accelerators", "plugins")


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"phalanx.{name}")
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")


__all__ = [
    "Callback",
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DataModule",
    "Fabric",
    "GradientSyncError",
    "LightningCLI",
    "LightningDataModule",
    "LightningModule",
    "MisconfigurationError",
    "Module",
    "PhalanxError",
    "PhalanxWarning",
    "RankGoneError",
    "Trainer",
    "is_wrapped",
    "seed_everything",
]
