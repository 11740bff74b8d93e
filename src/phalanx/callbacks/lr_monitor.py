"""``LearningRateMonitor``: send each parameter group's learning rate to the loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer

from phalanx.callbacks.base import Callback
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.module import Module
    from phalanx.core.view import TrainerView


class LearningRateMonitor(Callback):
    """Logs ``lr-<Optimizer>`` (``lr-<Optimizer>/pg<i>`` with several param groups).

    Args:
        logging_interval: "step" (after each optimizer step, every ``log_every_n_steps``) or "epoch"
            (at the start of each epoch).
        log_momentum: also log ``momentum-<Optimizer>`` (beta1 for Adam-style optimizers).
    """

    def __init__(self, logging_interval: str = "step", log_momentum: bool = False) -> None:
        if logging_interval not in ("step", "epoch"):
            raise MisconfigurationError(f"logging_interval={logging_interval!r}; use 'step' or 'epoch'.")
        self.logging_interval, self.log_momentum = logging_interval, log_momentum
        self._last_step = -1
        self.last_values: dict[str, float] = {}

    def setup(self, trainer: TrainerView, module: Module, stage: str) -> None:
        if stage == "fit" and not trainer.loggers:
            raise MisconfigurationError("LearningRateMonitor needs a logger: pass Trainer(logger=...) (not False).")

    def values(self, optimizer: Optimizer) -> dict[str, float]:
        name = type(getattr(optimizer, "optimizer", optimizer)).__name__
        groups = optimizer.param_groups
        out: dict[str, float] = {}
        for i, group in enumerate(groups):
            suffix = f"/pg{i}" if len(groups) > 1 else ""
            out[f"lr-{name}{suffix}"] = float(group["lr"])
            if self.log_momentum:
                momentum = group.get("momentum", group.get("betas", (None,))[0])
                if momentum is not None:
                    out[f"momentum-{name}{suffix}"] = float(momentum)
        return out

    def _log(self, trainer: TrainerView) -> None:
        if trainer.optimizer is None:
            return
        self.last_values = self.values(trainer.optimizer)
        trainer.fabric.log_dict(self.last_values, step=trainer.global_step)

    def on_train_batch_end(
        self, trainer: TrainerView, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.logging_interval == "step" and step != self._last_step and step % trainer.log_every_n_steps == 0:
            self._last_step = step
            self._log(trainer)

    def on_train_epoch_start(self, trainer: TrainerView, module: Module) -> None:
        if self.logging_interval == "epoch":
            self._log(trainer)
