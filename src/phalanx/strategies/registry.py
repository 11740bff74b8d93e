"""The strategy names: one constant table, where each backend declares the strings that select it.

``Fabric(strategy="deepspeed_stage_2")`` and ``Trainer(strategy=...)`` name a backend by string. Each
entry of :data:`BACKENDS` holds one backend's class (as a loader: fsdp, model_parallel and deepspeed
import torch.distributed.fsdp/tensor/checkpoint or DeepSpeed, so their modules are imported only
when one of their names is asked for, and ``import phalanx`` stays fast), the names that select it,
and the constructor arguments each name implies (``deepspeed_stage_2`` -> ``stage=2``). Resolving a
name, listing the valid names and the lazy class attributes of :mod:`phalanx.strategies` all read
this table and nothing else. It is a constant: nothing registers at run time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from phalanx.strategies.base import Strategy
from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.single import SingleDeviceStrategy
from phalanx.utils import diagnostics
from phalanx.utils.errors import MisconfigurationError

# What the aliases of ddp say when used: phalanx has no start methods to choose between.
_LAUNCHER_ALIAS = (
    "strategy={name!r} runs as strategy='ddp': phalanx always starts its processes with torch's launcher "
    "(fabric.launch(), `phalanx run` or torchrun), so there is no spawn/fork start method to choose. "
    "Write strategy='ddp'."
)


def _frozen(names: dict[str, dict[str, Any]]) -> Mapping[str, Mapping[str, Any]]:
    return MappingProxyType({name: MappingProxyType(kwargs) for name, kwargs in names.items()})


@dataclass(frozen=True)
class Backend:
    """One backend's entry in the table.

    Attributes:
        attr: the class's name, also its attribute on :mod:`phalanx.strategies`.
        load: returns the class (importing its module: heavy backends import only here).
        names: each string name of this backend -> the constructor keyword arguments it implies.
        aliases: names kept for Lightning scripts -> the one-line info shown when one is used.
        one_process: the backend runs in one process (refused for ``devices * num_nodes > 1``).
    """

    attr: str
    load: Callable[[], type[Strategy]]
    names: Mapping[str, Mapping[str, Any]]
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    one_process: bool = False

    def create(self, name: str) -> Strategy:
        return self.load()(**self.names[name])


def _single() -> type[Strategy]:
    return SingleDeviceStrategy


def _ddp() -> type[Strategy]:
    return DDPStrategy


def _fsdp() -> type[Strategy]:
    from phalanx.strategies.fsdp.strategy import FSDPStrategy

    return FSDPStrategy


def _model_parallel() -> type[Strategy]:
    from phalanx.strategies.model_parallel import ModelParallelStrategy

    return ModelParallelStrategy


def _deepspeed() -> type[Strategy]:
    from phalanx.strategies.deepspeed.strategy import DeepSpeedStrategy  # imports no DeepSpeed until setup

    return DeepSpeedStrategy


BACKENDS: tuple[Backend, ...] = (
    Backend("SingleDeviceStrategy", _single, _frozen({"single": {}, "single_device": {}}), one_process=True),
    Backend(
        "DDPStrategy",
        _ddp,
        _frozen({
            "ddp": {},
            # Lightning's names for DDP(find_unused_parameters=...).
            "ddp_find_unused_parameters_true": {"find_unused_parameters": True},
            "ddp_find_unused_parameters_false": {},
            "ddp_spawn": {},
            "ddp_fork": {},
        }),
        aliases=MappingProxyType({name: _LAUNCHER_ALIAS.format(name=name) for name in ("ddp_spawn", "ddp_fork")}),
    ),
    Backend("FSDPStrategy", _fsdp, _frozen({"fsdp": {}})),
    Backend("ModelParallelStrategy", _model_parallel, _frozen({"model_parallel": {}})),
    Backend(
        "DeepSpeedStrategy",
        _deepspeed,
        _frozen({"deepspeed": {}, **{f"deepspeed_stage_{stage}": {"stage": stage} for stage in (1, 2, 3)}}),
    ),
)


def available_strategies() -> list[str]:
    """Every string ``strategy=`` accepts, ``"auto"`` first."""
    return ["auto", *(name for backend in BACKENDS for name in backend.names)]


def strategy_class(attr: str) -> type[Strategy] | None:
    """The class exported as ``phalanx.strategies.<attr>`` (imported now), or None."""
    return next((backend.load() for backend in BACKENDS if backend.attr == attr), None)


def resolve_strategy(strategy: str | Strategy, num_processes: int) -> Strategy:
    """The strategy object for ``Fabric(strategy=...)``: a Strategy instance as is, or a new one for a name."""
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise MisconfigurationError(
            f"strategy must be a string or a phalanx Strategy instance, got {type(strategy).__name__}."
        )
    key = strategy.lower()
    if key == "auto":
        return DDPStrategy() if num_processes > 1 else SingleDeviceStrategy()
    backend = next((b for b in BACKENDS if key in b.names), None)
    if backend is None:
        raise MisconfigurationError(
            f"Unknown strategy {strategy!r}. Choose one of {', '.join(map(repr, available_strategies()))}, "
            "or pass a Strategy instance."
        )
    if backend.one_process and num_processes > 1:
        raise MisconfigurationError(
            f"strategy={strategy!r} runs one process, but devices*num_nodes={num_processes}. "
            "Use strategy='ddp' (or 'auto'), or devices=1."
        )
    if key in backend.aliases:
        diagnostics.info(backend.aliases[key], rank=int(os.environ.get("RANK", "0")))
    return backend.create(key)


__all__ = ["BACKENDS", "Backend", "available_strategies", "resolve_strategy", "strategy_class"]
