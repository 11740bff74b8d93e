"""``EarlyStopping``: stop fitting when a metric stops improving.

The decision is taken from ``trainer.callback_metrics``, which is identical on every rank, so all
ranks stop at the same epoch (no rank is left waiting in a collective).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from phalanx.callbacks.base import Callback
from phalanx.utils.diagnostics import info, warn
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.module import Module
    from phalanx.core.view import TrainerView


class EarlyStopping(Callback):
    """Checked after each validation of a fit, or at the end of each training epoch (Lightning's rule).

    Args:
        monitor: metric name in ``trainer.callback_metrics``.
        min_delta: smallest change that counts as an improvement.
        patience: epochs without improvement before stopping.
        mode: "min" or "max".
        strict: raise when the metric is missing (otherwise skip the check, saying so once).
        check_finite: stop when the metric becomes NaN or infinite.
        stopping_threshold: stop as soon as the metric is better than this.
        divergence_threshold: stop as soon as the metric is worse than this.
        check_on_train_epoch_end: check at the end of each training epoch (True) or after each validation
            of the fit (False). None, as in Lightning: at epoch end when validation runs once per epoch
            (``val_check_interval=1.0``, ``check_val_every_n_epoch=1``), else after each validation, so
            ``patience`` counts validations when the fit validates mid-epoch.
    """

    skip_in_fast_dev_run = True  # it stops: fast_dev_run is a smoke test

    def __init__(
        self, monitor: str, min_delta: float = 0.0, patience: int = 3, mode: str = "min", strict: bool = True,
        check_finite: bool = True, stopping_threshold: float | None = None, divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
    ) -> None:
        if mode not in ("min", "max"):
            raise MisconfigurationError(f"EarlyStopping mode={mode!r}; use 'min' or 'max'.")
        if patience < 0:
            raise MisconfigurationError(f"patience must be >= 0, got {patience}.")
        self.monitor, self.min_delta, self.patience, self.mode = monitor, abs(min_delta), patience, mode
        self.strict, self.check_finite = strict, check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopped_epoch = 0
        self.reason = ""
        self._warned = False
        self._check_on_train_epoch_end = check_on_train_epoch_end
        self._at_epoch_end = check_on_train_epoch_end is not False

    def setup(self, trainer: TrainerView, module: Module, stage: str) -> None:
        if self._check_on_train_epoch_end is None:
            self._at_epoch_end = trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def on_train_epoch_end(self, trainer: TrainerView, module: Module) -> None:
        if self._at_epoch_end:
            self._check(trainer)

    def on_validation_end(self, trainer: TrainerView, module: Module) -> None:
        if not self._at_epoch_end and trainer.stage == "fit" and not trainer.sanity_checking:
            self._check(trainer)

    def _check(self, trainer: TrainerView) -> None:
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            if self.strict:
                raise MisconfigurationError(
                    f"EarlyStopping(monitor={self.monitor!r}) found no such metric; logged metrics: {sorted(metrics)}. "
                    "Log it (e.g. self.log('val_loss', loss) in validation_step) or pass strict=False."
                )
            if not self._warned:
                warn(f"EarlyStopping: {self.monitor!r} is not logged yet, so it is not checked. Log it with "
                     "self.log(...) before the end of each training epoch, or remove the callback.",
                     rank=trainer.global_rank)
                self._warned = True
            return
        stop, reason = self.evaluate(float(metrics[self.monitor]))
        if stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.reason = reason
            info(f"EarlyStopping at epoch {trainer.current_epoch}: {reason}", rank=trainer.global_rank)

    def evaluate(self, current: float) -> tuple[bool, str]:
        """Update the state with ``current``; return whether to stop and why."""
        name = self.monitor
        if self.check_finite and not math.isfinite(current):
            return True, f"{name} = {current} is not finite."
        if self.stopping_threshold is not None and self._better(current, self.stopping_threshold):
            return True, f"{name} = {current:.6g} reached the stopping threshold {self.stopping_threshold}."
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, current):
            return True, f"{name} = {current:.6g} diverged past {self.divergence_threshold}."
        shifted = current + self.min_delta if self.mode == "min" else current - self.min_delta
        if self._better(shifted, self.best_score):
            self.best_score, self.wait_count = current, 0
            return False, ""
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (f"{name} did not improve by more than {self.min_delta} for {self.wait_count} checks "
                          f"(best {self.best_score:.6g}).")
        return False, ""

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "best_score": self.best_score, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_count, self.best_score = state["wait_count"], state["best_score"]
        self.stopped_epoch = state["stopped_epoch"]
