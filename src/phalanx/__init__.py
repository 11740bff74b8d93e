"""phalanx: PyTorch training from one CPU to many devices, correct by construction.

Heavy optional dependencies (tensorboard, matplotlib, deepspeed, rich) are imported only when used,
so ``import phalanx`` costs little more than ``import torch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx.errors import (
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
from phalanx.fabric import Fabric
from phalanx.seed import seed_everything

__version__ = "0.1.0"

if TYPE_CHECKING:
    from phalanx.trainer import DataModule, Module, Trainer

_LAZY = {"Trainer": "phalanx.trainer", "Module": "phalanx.trainer", "DataModule": "phalanx.trainer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DataModule",
    "Fabric",
    "GradientSyncError",
    "MisconfigurationError",
    "Module",
    "PhalanxError",
    "PhalanxWarning",
    "RankGoneError",
    "Trainer",
    "seed_everything",
]
