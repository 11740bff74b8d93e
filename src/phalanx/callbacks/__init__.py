"""Callbacks for ``phalanx.Trainer``. Any object with methods of the hook names works as a callback;
these ship with phalanx, under Lightning's names.

``LearningRateFinder`` and ``BatchSizeFinder`` live with the tuner they run (:mod:`phalanx.tuner`, a
layer above the Trainer); this package names them too, as Lightning does, resolved on first use so no
code below the tuner depends on it."""

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

_TUNER_CALLBACKS = {"LearningRateFinder": "lr_finder_callback", "BatchSizeFinder": "batch_size_callback"}


def __getattr__(name: str) -> Any:
    if name in _TUNER_CALLBACKS:
        import importlib

        return getattr(importlib.import_module(f"phalanx.tuner.{_TUNER_CALLBACKS[name]}"), name)
    raise AttributeError(f"module 'phalanx.callbacks' has no attribute {name!r}")
