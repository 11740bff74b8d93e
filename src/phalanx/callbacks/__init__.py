"""Callbacks for ``phalanx.Trainer``. Any object with methods of the hook names works as a callback;
these ship with phalanx, under Lightning's names.

``LearningRateFinder`` and ``BatchSizeFinder`` live with the tuner they run (:mod:`phalanx.tuner`, a
layer above the Trainer: the search drives the Trainer's loops). This package names them too, as
Lightning does, and imports them on first use, so importing it loads nothing above it. These two are
the only upward edges in the layers; pyproject.toml's layers contract lists them, so any other fails
``lint-imports``."""

from __future__ import annotations

from typing import Any

from phalanx.callbacks.base import Callback
from phalanx.callbacks.early_stopping import EarlyStopping
from phalanx.callbacks.gradient_accumulation_scheduler import GradientAccumulationScheduler
from phalanx.callbacks.lambda_function import LambdaCallback
from phalanx.callbacks.lr_monitor import LearningRateMonitor
from phalanx.callbacks.model_checkpoint import ModelCheckpoint
from phalanx.callbacks.model_summary import ModelSummary, RichModelSummary
from phalanx.callbacks.prediction_writer import BasePredictionWriter
from phalanx.callbacks.progress import ProgressBar, RichProgressBar, TQDMProgressBar
from phalanx.callbacks.snapshot import Snapshot
from phalanx.callbacks.throughput import ThroughputMonitor
from phalanx.callbacks.timer import Timer

__all__ = [
    "BasePredictionWriter",
    "BatchSizeFinder",
    "Callback",
    "EarlyStopping",
    "GradientAccumulationScheduler",
    "LambdaCallback",
    "LearningRateFinder",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "RichModelSummary",
    "RichProgressBar",
    "Snapshot",
    "TQDMProgressBar",
    "ThroughputMonitor",
    "Timer",
]


def __getattr__(name: str) -> Any:
    if name == "LearningRateFinder":
        from phalanx.tuner.lr_finder_callback import LearningRateFinder

        return LearningRateFinder
    if name == "BatchSizeFinder":
        from phalanx.tuner.batch_size_callback import BatchSizeFinder

        return BatchSizeFinder
    raise AttributeError(f"module 'phalanx.callbacks' has no attribute {name!r}")
