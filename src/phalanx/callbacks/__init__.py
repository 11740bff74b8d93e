"""Callbacks for ``phalanx.Trainer``. Any object with methods of the hook names works as a callback;
these ship with phalanx, under Lightning's names."""

from phalanx.callbacks.base import Callback
from phalanx.callbacks.batch_size_finder import BatchSizeFinder
from phalanx.callbacks.checkpoint import ModelCheckpoint
from phalanx.callbacks.early_stopping import EarlyStopping
from phalanx.callbacks.extras import (
    BasePredictionWriter,
    GradientAccumulationScheduler,
    LambdaCallback,
    RichProgressBar,
    TQDMProgressBar,
)
from phalanx.callbacks.lr_finder import LearningRateFinder
from phalanx.callbacks.lr_monitor import LearningRateMonitor
from phalanx.callbacks.model_summary import ModelSummary, RichModelSummary
from phalanx.callbacks.progress import ProgressBar
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
    "TQDMProgressBar",
    "Timer",
]
