"""One strategy per backend. Which string names which backend is declared in one table
(:mod:`phalanx.strategies.registry`); heavy backends (fsdp, model_parallel, deepspeed) are imported only
when one is asked for, by name or as an attribute of this package."""

from __future__ import annotations

from typing import Any

from phalanx.strategies.base import Strategy
from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.parallel import ParallelStrategy
from phalanx.strategies.registry import available_strategies, resolve_strategy, strategy_class
from phalanx.strategies.single import SingleDeviceStrategy


def __getattr__(name: str) -> Any:
    # FSDPStrategy/ModelParallelStrategy import torch.distributed.fsdp/checkpoint: only when someone asks.
    cls = strategy_class(name)
    if cls is None:
        raise AttributeError(f"module 'phalanx.strategies' has no attribute {name!r}")
    return cls


__all__ = [
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "ParallelStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "available_strategies",
    "resolve_strategy",
]
