"""Reading what ``configure_optimizers`` returns, and stepping schedulers on the right clock."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau

from phalanx.utils.errors import MisconfigurationError

_INTERVALS = ("step", "epoch")


@dataclass
class SchedulerConfig:
    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    name: str | None = None


def _scheduler_config(value: Any) -> SchedulerConfig:
    if isinstance(value, Mapping):
        if "scheduler" not in value:
            raise MisconfigurationError(
                f"An lr_scheduler config dict needs a 'scheduler' key; got keys {sorted(value)}."
            )
        unknown = set(value) - {"scheduler", "interval", "frequency", "monitor", "name", "strict"}
        if unknown:
            raise MisconfigurationError(f"Unknown lr_scheduler config keys {sorted(unknown)}.")
        config = SchedulerConfig(
            value["scheduler"], value.get("interval", "epoch"), int(value.get("frequency", 1)),
            value.get("monitor"), value.get("name"),
        )
    else:
        config = SchedulerConfig(value)
    if config.interval not in _INTERVALS:
        raise MisconfigurationError(f"lr_scheduler interval={config.interval!r}; use 'step' or 'epoch'.")
    if config.frequency < 1:
        raise MisconfigurationError(f"lr_scheduler frequency must be >= 1, got {config.frequency}.")
    if isinstance(config.scheduler, ReduceLROnPlateau) and config.monitor is None:
        raise MisconfigurationError(
            "ReduceLROnPlateau needs a metric: return {'optimizer': opt, 'lr_scheduler': {'scheduler': sched, "
            "'monitor': 'val_loss'}} from configure_optimizers."
        )
    if not hasattr(config.scheduler, "step") or not hasattr(config.scheduler, "state_dict"):
        raise MisconfigurationError(
            f"lr_scheduler {type(config.scheduler).__name__} has no step()/state_dict(); pass a torch LR scheduler."
        )
    return config


def parse_all_optimizers(value: Any) -> tuple[list[Optimizer], list[SchedulerConfig]]:
    """The optimizers and schedulers from any supported ``configure_optimizers`` return value: an
    optimizer; a dict with ``optimizer`` (and ``lr_scheduler``); a list of optimizers or of such dicts;
    ``([optimizers], [schedulers])``; or None (no optimizer: manual optimization only)."""
    optimizers: list[Any]
    schedulers: list[Any] = []
    if value is None:
        return [], []
    if isinstance(value, Optimizer):
        optimizers = [value]
    elif isinstance(value, Mapping):
        if "optimizer" not in value:
            raise MisconfigurationError(
                f"configure_optimizers returned a dict without an 'optimizer' key (keys: {sorted(value)})."
            )
        optimizers = [value["optimizer"]]
        if value.get("lr_scheduler") is not None:
            schedulers = [value["lr_scheduler"]]
    elif isinstance(value, Sequence) and len(value) == 2 and all(isinstance(v, Sequence) for v in value):
        optimizers, schedulers = list(value[0]), list(value[1])
    elif isinstance(value, Sequence) and value and all(isinstance(v, Mapping) for v in value):
        optimizers, schedulers = [], []
        for item in value:
            opts, scheds = parse_all_optimizers(item)
            optimizers += opts
            schedulers += [{"scheduler": c.scheduler, "interval": c.interval, "frequency": c.frequency,
                            "monitor": c.monitor, "name": c.name} for c in scheds]
    elif isinstance(value, Sequence):
        optimizers = list(value)
    else:
        raise MisconfigurationError(
            f"configure_optimizers returned {type(value).__name__}; return an optimizer, a dict with 'optimizer' "
            "(and optionally 'lr_scheduler'), or ([optimizer], [scheduler])."
        )
    for opt in optimizers:
        if not isinstance(opt, Optimizer):
            raise MisconfigurationError(
                f"configure_optimizers returned a {type(opt).__name__}, not a torch.optim.Optimizer."
            )
    configs = [_scheduler_config(s) for s in schedulers]
    for c in configs:
        owner = getattr(c.scheduler, "optimizer", optimizers[0] if optimizers else None)
        if not any(owner is opt for opt in optimizers):
            raise MisconfigurationError("An lr_scheduler was built for a different optimizer than the ones returned.")
    return optimizers, configs


def parse_optimizers(value: Any) -> tuple[Optimizer, list[SchedulerConfig]]:
    """Exactly one optimizer and its schedulers (automatic optimization)."""
    optimizers, configs = parse_all_optimizers(value)
    if len(optimizers) != 1:
        raise MisconfigurationError(
            f"configure_optimizers returned {len(optimizers)} optimizers; the Trainer steps exactly one. Put all "
            "parameters in one optimizer (use param groups for different settings), or set "
            "self.automatic_optimization = False and step them yourself in training_step."
        )
    return optimizers[0], configs


def step_schedulers(
    module: Any, configs: list[SchedulerConfig], interval: str, count: int, metrics: Mapping[str, Any]
) -> None:
    """Step the schedulers of ``interval`` whose frequency divides ``count`` (steps or epochs done)."""
    for config in configs:
        if config.interval != interval or count % config.frequency != 0:
            continue
        metric = None
        if config.monitor is not None:
            if config.monitor not in metrics:
                raise MisconfigurationError(
                    f"The lr_scheduler monitors {config.monitor!r}, which was not logged; logged metrics: "
                    f"{sorted(metrics)}. Log it with self.log({config.monitor!r}, ...) or change 'monitor'."
                )
            metric = float(metrics[config.monitor])
        module.lr_scheduler_step(config.scheduler, metric)
