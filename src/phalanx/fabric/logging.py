"""The loggers of one Fabric and their lifecycle, written in one place.

* Only global rank 0 calls a logger. Here: metrics (``fabric.log_dict``), hyperparameters
  (``fabric.log_hyperparams``; the Trainer's when a fit starts) and ``finalize``. The Trainer tells them
  about each checkpoint a ``ModelCheckpoint`` wrote (``after_save_checkpoint``), as Lightning's does.
* ``finalize``: at the end of each Trainer stage (as in Lightning, a stage ends its loggers' runs; a logger
  may be used again by the next one) and when the job ends (``fabric.teardown``, or at interpreter exit),
  "failed" if it ends with an error. A logger's ``finalize`` therefore runs more than once and flushes what
  it buffered since the last one.

Every logger is a ``Logger`` subclass, checked here when the Fabric is built, so no call can find a
method missing halfway through a run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from phalanx.loggers import Logger
from phalanx.utils.errors import MisconfigurationError


def _checked(loggers: list[Any]) -> list[Logger]:
    for i, lg in enumerate(loggers):
        if not isinstance(lg, Logger):
            raise MisconfigurationError(
                f"loggers[{i}] is a {type(lg).__name__}, not a phalanx.loggers.Logger. Subclass Logger (every method "
                "but log_metrics(metrics, step) has a default that does nothing), or use CSVLogger or "
                "TensorBoardLogger from phalanx.loggers."
            )
    return loggers


class Logging:
    """The loggers of one Fabric (see the module docstring); ``is_global_zero`` is asked at every call, since
    a Fabric learns its rank when it joins the job."""

    def __init__(self, loggers: list[Any], is_global_zero: Callable[[], bool]) -> None:
        self.loggers = _checked(loggers)
        self._is_global_zero = is_global_zero

    @property
    def root_dir(self) -> Path | None:
        """The first logger's ``root_dir`` that is not None."""
        return next((Path(lg.root_dir) for lg in self.loggers if lg.root_dir is not None), None)

    def _called(self) -> list[Logger]:
        return self.loggers if self._is_global_zero() else []

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None) -> None:
        loggers = self._called()
        if loggers:
            plain = {k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
            for lg in loggers:
                lg.log_metrics(plain, step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        for lg in self._called():
            lg.log_hyperparams(params)

    def finalize(self, status: str) -> None:
        for lg in self._called():
            lg.finalize(status)
