"""String names of the strategies whose modules are imported only when asked for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FACTORIES: dict[str, Callable[[], Any]] = {}


def _fsdp() -> Any:
    from phalanx.strategies.fsdp.strategy import FSDPStrategy

    return FSDPStrategy()


FACTORIES["fsdp"] = _fsdp


def _model_parallel() -> Any:
    from phalanx.strategies.model_parallel import ModelParallelStrategy

    return ModelParallelStrategy()


FACTORIES["model_parallel"] = _model_parallel


def _deepspeed(stage: int | None = None) -> Callable[[], Any]:
    def make() -> Any:
        from phalanx.strategies.deepspeed.strategy import DeepSpeedStrategy  # imports no DeepSpeed until setup

        return DeepSpeedStrategy(stage=stage)

    return make


FACTORIES["deepspeed"] = _deepspeed()
for _stage in (1, 2, 3):
    FACTORIES[f"deepspeed_stage_{_stage}"] = _deepspeed(_stage)
