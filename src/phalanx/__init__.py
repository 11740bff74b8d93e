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

from phalanx.fabric.fabric import Fabric
from phalanx.fabric.wrappers import is_wrapped
from phalanx.utils.seed import seed_everything

__version__ = "0.1.0"

if TYPE_CHECKING:
    from phalanx.callbacks import Callback
    from phalanx.cli.config import LightningCLI
    from phalanx.core.datamodule import DataModule
    from phalanx.core.module import Module
    from phalanx.distributed.replica_groups import FaultTolerance
    from phalanx.trainer.trainer import Trainer

    LightningModule = Module
    LightningDataModule = DataModule

# name -> (module, attribute); imported on first use so `import phalanx` stays light.
_LAZY = {
    "Trainer": ("phalanx.trainer.trainer", "Trainer"),
    "Module": ("phalanx.core.module", "Module"),
    "DataModule": ("phalanx.core.datamodule", "DataModule"),
    "LightningModule": ("phalanx.core.module", "Module"),
    "LightningDataModule": ("phalanx.core.datamodule", "DataModule"),
    "Callback": ("phalanx.callbacks", "Callback"),
    "FaultTolerance": ("phalanx.distributed.replica_groups", "FaultTolerance"),
    "LightningCLI": ("phalanx.cli.config", "LightningCLI"),
}
_SUBMODULES = ("errors", "callbacks", "loggers", "profilers", "tuner", "utilities", "cli", "strategies", "trainer",
               "checkpoint", "accelerators", "plugins")


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
    "DataModule",
    "Fabric",
    "FaultTolerance",
    "LightningCLI",
    "LightningDataModule",
    "LightningModule",
    "Module",
    "Trainer",
    "is_wrapped",
    "seed_everything",
]
