"""``TrainerView``: what the code below the Trainer may use of a Trainer.

The Trainer declares its public attributes once, on its own class (:mod:`phalanx.trainer.attributes`).
This protocol exists only because ``core`` sits below ``trainer`` and still has to type
``Module.trainer``: the Module, the DataModule, the restore points of :mod:`phalanx.core.module_state`
and the callbacks run inside a Trainer but may not import it (docs/architecture.md). It lists the
subset they use, and mypy checks the Trainer against it wherever a Trainer is passed down
(``module._trainer = trainer``, ``TrainerRestorePoint(trainer)``, ``callback.hook(trainer, ...)``).

Members are read-only properties unless code below the Trainer writes them (``should_stop``), so
the Trainer may hold each as a plain attribute, a property or a delegate to its loop state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from phalanx.core.toggling import Toggleable
from phalanx.fabric.fabric import Fabric


class LogSink(Protocol):
    """Where ``Module.log`` records a value: the metrics of the loop running now."""

    def log(
        self, name: str, value: Any, on_step: bool | None, on_epoch: bool | None, prog_bar: bool,
        logger: bool, sync_dist: bool, reduce_fx: Any, batch_size: int | None, module: Any = None,
    ) -> None: ...


class LogTarget(Protocol):
    """The Trainer's logged results as ``Module.log`` sees them (``trainer.logger_connector``)."""

    def sink(self, stage: str | None) -> LogSink:
        """Where values logged while ``stage`` runs are recorded; raises outside the loops that log."""
        ...


class SchedulerView(Protocol):
    """One learning-rate scheduler entry of ``configure_optimizers``."""

    @property
    def scheduler(self) -> Any: ...


class TrainerView(Protocol):
    """The Trainer as the Module, its restore points and the callbacks see it (see the module docstring)."""

    # ------------------------------------------------------------------ processes and devices
    @property
    def fabric(self) -> Fabric: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def world_size(self) -> int: ...
    @property
    def loggers(self) -> list[Any]: ...
    def print(self, *args: Any, **kwargs: Any) -> None: ...

    # ------------------------------------------------------------------ where the loops are
    @property
    def stage(self) -> str | None: ...
    @property
    def current_stage(self) -> str | None: ...
    @property
    def sanity_checking(self) -> bool: ...
    @property
    def global_step(self) -> int: ...
    @property
    def current_epoch(self) -> int: ...
    @property
    def batches_done(self) -> int: ...
    @property
    def in_window(self) -> bool: ...
    @property
    def num_training_batches(self) -> int | None: ...
    @property
    def num_eval_batches(self) -> list[int | None]: ...
    @property
    def estimated_stepping_batches(self) -> int: ...
    @property
    def should_stop(self) -> bool: ...
    @should_stop.setter
    def should_stop(self, value: bool) -> None: ...

    # ------------------------------------------------------------------ settings callbacks read
    @property
    def max_epochs(self) -> int: ...
    @property
    def max_steps(self) -> int: ...
    @property
    def log_every_n_steps(self) -> int: ...
    @property
    def val_check_interval(self) -> int | float: ...
    @property
    def check_val_every_n_epoch(self) -> int | None: ...

    # ------------------------------------------------------------------ metrics
    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]: ...
    @property
    def progress_bar_metrics(self) -> dict[str, float]: ...
    @property
    def logger_connector(self) -> LogTarget: ...

    # ------------------------------------------------------------------ model and optimization
    @property
    def module(self) -> nn.Module: ...
    @property
    def model(self) -> Any: ...
    @property
    def optimizer(self) -> Any: ...
    @property
    def optimizers(self) -> list[Any]: ...
    @property
    def step_optimizers(self) -> Sequence[Any]: ...
    @property
    def lr_scheduler_configs(self) -> Sequence[SchedulerView]: ...

    # The step machinery behind the Module's methods of the same names (``phalanx.trainer.stepping``):
    # the Module calls these, so it never imports the Trainer's code.
    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None: ...
    def toggle_optimizer(self, module: Toggleable, optimizer: Any) -> None: ...
    def untoggle_optimizer(self, module: Toggleable) -> None: ...
    def clip_gradients(self, optimizer: Any, value: float | None, algorithm: str | None) -> None: ...

    # ------------------------------------------------------------------ restore points (tuning phases)
    def capture_loop(self) -> Callable[[], None]:
        """The loops' own state now (counters, published metrics and accumulators, sampler position);
        calling the result puts it back."""
        ...
