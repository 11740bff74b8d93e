"""Callbacks for ``phalanx.Trainer``. Any object with methods of the hook names works as a callback;
these ship with phalanx, under Lightning's names. ``LearningRateFinder`` and ``BatchSizeFinder`` run the
tuner's searches (:mod:`phalanx.tuner`, a layer below: it uses the Trainer only through the methods
:class:`phalanx.tuner.view.TunedTrainer` declares)."""

from __future__ import annotations

from phalanx.callbacks.base import Callback
from phalanx.callbacks.batch_size_finder import BatchSizeFinder
from phalanx.callbacks.early_stopping import EarlyStopping
from phalanx.callbacks.gradient_accumulation_scheduler import GradientAccumulationScheduler
from phalanx.callbacks.lambda_function import LambdaCallback
from phalanx.callbacks.lr_finder import LearningRateFinder
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

