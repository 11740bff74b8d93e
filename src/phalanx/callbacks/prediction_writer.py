"""``BasePredictionWriter``: write ``predict_step`` outputs as they are made."""

from __future__ import annotations

from typing import Any

from phalanx.callbacks.base import Callback
from phalanx.utils.errors import MisconfigurationError


class BasePredictionWriter(Callback):
    """Subclass and implement ``write_on_batch_end`` and/or ``write_on_epoch_end``; ``write_interval``
    ("batch", "epoch" or "batch_and_epoch") says which is called. Each rank writes its own share."""

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
