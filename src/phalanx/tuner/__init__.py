"""Tuning phases that leave no trace: the LR range test (``lr_find``) and the batch-size search (``batch_size``).
The callbacks that run them when fit starts are ``phalanx.callbacks.LearningRateFinder`` and ``BatchSizeFinder``."""

from phalanx.tuner.lr_find import LRFinderResult, Tuner

__all__ = ["LRFinderResult", "Tuner"]
