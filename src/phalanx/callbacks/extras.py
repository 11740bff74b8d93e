"""Lightning's remaining everyday callbacks under their names: ``TQDMProgressBar``,
``RichProgressBar``, ``LambdaCallback`` and ``BasePredictionWriter``.

The failure this prevents: a ported ``callbacks=[TQDMProgressBar(refresh_rate=10)]`` that fails on
import, or a prediction writer whose ``write_on_batch_end`` is never called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.callbacks.base import Callback
from phalanx.callbacks.progress import ProgressBar
from phalanx.utils.errors import MisconfigurationError


class TQDMProgressBar(ProgressBar):
    """The tqdm progress bar (rank 0). ``process_position`` must be 0 and ``leave`` False: one bar per
    stage, replaced at each epoch, is what phalanx draws."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        if process_position != 0 or leave:
            raise MisconfigurationError(
                "TQDMProgressBar(process_position=..., leave=True) is not supported; phalanx draws one bar per stage "
                "on rank 0. Remove those arguments."
            )
        super().__init__(refresh_rate=refresh_rate, backend="tqdm")


class RichProgressBar(ProgressBar):
    """The rich progress bar (rank 0; rich must be installed). Themes and console options are refused."""

    def __init__(self, refresh_rate: int = 1, leave: bool = False, theme: Any = None,
                 console_kwargs: dict[str, Any] | None = None) -> None:
        if leave or theme is not None or console_kwargs:
            raise MisconfigurationError(
                "RichProgressBar(leave=/theme=/console_kwargs=) is not supported; remove those arguments."
            )
        super().__init__(refresh_rate=refresh_rate, backend="rich")


class LambdaCallback(Callback):
    """A callback from functions: ``LambdaCallback(on_train_epoch_end=lambda trainer, module: ...)``."""

    def __init__(self, **hooks: Callable[..., Any] | None) -> None:
        for name, fn in hooks.items():
            if not name.startswith(("on_", "setup", "teardown")) or not hasattr(Callback, name):
                raise MisconfigurationError(f"LambdaCallback got {name!r}, which is not a callback hook.")
            if fn is not None:
                setattr(self, name, fn)


class BasePredictionWriter(Callback):
    """Subclass and implement ``write_on_batch_end`` and/or ``write_on_epoch_end`` to write predictions
    as they are made (each rank writes its own share)."""

    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in ("batch", "epoch", "batch_and_epoch"):
            raise MisconfigurationError(
                f"write_interval={write_interval!r}; use 'batch', 'epoch' or 'batch_and_epoch'."
            )
        self.interval = write_interval
        self._predictions: list[Any] = []
        self._indices: list[Any] = []

    def write_on_batch_end(self, trainer: Any, module: Any, prediction: Any, batch_indices: Any, batch: Any,
                           batch_idx: int, dataloader_idx: int) -> None:
        raise NotImplementedError

    def write_on_epoch_end(self, trainer: Any, module: Any, predictions: Any, batch_indices: Any) -> None:
        raise NotImplementedError

    def on_predict_epoch_start(self, trainer: Any, module: Any) -> None:
        self._predictions, self._indices = [], []

    def on_predict_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        if self.interval in ("batch", "batch_and_epoch"):
            self.write_on_batch_end(trainer, module, outputs, None, batch, batch_idx, dataloader_idx)
        if self.interval in ("epoch", "batch_and_epoch"):
            self._predictions.append(outputs)

    def on_predict_epoch_end(self, trainer: Any, module: Any) -> None:
        if self.interval in ("epoch", "batch_and_epoch"):
            self.write_on_epoch_end(trainer, module, self._predictions, self._indices)


class GradientAccumulationScheduler(Callback):
    """Change ``accumulate_grad_batches`` by epoch: ``GradientAccumulationScheduler({0: 1, 4: 2, 8: 4})``
    accumulates 2 batches from epoch 4 and 4 from epoch 8 (the window sizes of an epoch are fixed at its
    start, so accumulation keeps its meaning on every strategy)."""

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not scheduling or any(not isinstance(k, int) or k < 0 for k in scheduling) or any(
                not isinstance(v, int) or v < 1 for v in scheduling.values()):
            raise MisconfigurationError(
                f"GradientAccumulationScheduler scheduling={scheduling!r}: keys are epochs >= 0, values ints >= 1."
            )
        self.scheduling = dict(sorted(scheduling.items()))
        if 0 not in self.scheduling:
            self.scheduling[0] = 1
            self.scheduling = dict(sorted(self.scheduling.items()))

    def going_to_accumulate_grad_batches(self, epoch: int) -> int:
        return next(v for k, v in reversed(self.scheduling.items()) if k <= epoch)

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        if not module.automatic_optimization:
            raise MisconfigurationError("GradientAccumulationScheduler is for automatic optimization.")
        if trainer.accumulate_grad_batches != 1:
            raise MisconfigurationError(
                "Pass accumulate_grad_batches through GradientAccumulationScheduler only, not also to the Trainer."
            )

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        trainer.accumulate_grad_batches = self.going_to_accumulate_grad_batches(trainer.current_epoch)
