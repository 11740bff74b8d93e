"""Callbacks for ``phalanx.Trainer``. Any object with methods of the hook names works as a callback;
these ship with phalanx."""

from phalanx.callbacks.base import Callback
from phalanx.callbacks.checkpoint import ModelCheckpoint
from phalanx.callbacks.early_stopping import EarlyStopping
from phalanx.callbacks.lr_finder import LearningRateFinder
from phalanx.callbacks.lr_monitor import LearningRateMonitor
from phalanx.callbacks.progress import ProgressBar

__all__ = ["Callback", "EarlyStopping", "LearningRateFinder", "LearningRateMonitor", "ModelCheckpoint", "ProgressBar"]
