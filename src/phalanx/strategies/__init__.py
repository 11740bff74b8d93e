"""One strategy per backend. Strings map to classes here; heavy backends import lazily."""

from __future__ import annotations

from typing import Any

from phalanx.strategies.base import Strategy
from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.parallel import ParallelStrategy
from phalanx.strategies.single import SingleDeviceStrategy
from phalanx.utils.errors import MisconfigurationError

STRATEGY_NAMES = ("auto", "single", "single_device", "ddp", "ddp_find_unused_parameters_true")


def resolve_strategy(strategy: str | Strategy, num_processes: int) -> Strategy:
    """The strategy object for ``Fabric(strategy=...)``."""
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise MisconfigurationError(
            f"strategy must be a string or a phalanx Strategy instance, got {type(strategy).__name__}."
        )
    key = strategy.lower()
    if key == "auto":
        return DDPStrategy() if num_processes > 1 else SingleDeviceStrategy()
    if key in ("single", "single_device"):
        if num_processes > 1:
            raise MisconfigurationError(
                f"strategy={strategy!r} runs one process, but devices*num_nodes={num_processes}. "
                "Use strategy='ddp' (or 'auto'), or devices=1."
            )
        return SingleDeviceStrategy()
    if key in ("ddp", "ddp_spawn", "ddp_fork", "ddp_find_unused_parameters_false"):
        return DDPStrategy()
    if key == "ddp_find_unused_parameters_true":  # Lightning's name for DDP(find_unused_parameters=True)
        return DDPStrategy(find_unused_parameters=True)
    extra = _lazy_strategy(key)
    if extra is not None:
        return extra
    raise MisconfigurationError(
        f"Unknown strategy {strategy!r}. Choose one of {', '.join(map(repr, available_strategies()))}, "
        "or pass a Strategy instance."
    )


def _lazy_strategy(key: str) -> Strategy | None:
    factories: dict[str, Any] = {}
    try:
        from phalanx.strategies import _registry

        factories = _registry.FACTORIES
    except ImportError:  # pragma: no cover - registry is part of the package
        pass
    factory = factories.get(key)
    return factory() if factory is not None else None


def available_strategies() -> list[str]:
    names = list(STRATEGY_NAMES)
    try:
        from phalanx.strategies import _registry

        names += list(_registry.FACTORIES)
    except ImportError:  # pragma: no cover
        pass
    return names


def __getattr__(name: str) -> Any:
    # FSDPStrategy/ModelParallelStrategy import torch.distributed.fsdp/checkpoint: only when someone asks.
    if name == "FSDPStrategy":
        from phalanx.strategies.fsdp.strategy import FSDPStrategy

        return FSDPStrategy
    if name == "ModelParallelStrategy":
        from phalanx.strategies.model_parallel import ModelParallelStrategy

        return ModelParallelStrategy
    if name == "DeepSpeedStrategy":
        from phalanx.strategies.deepspeed.strategy import DeepSpeedStrategy

        return DeepSpeedStrategy
    raise AttributeError(f"module 'phalanx.strategies' has no attribute {name!r}")


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
