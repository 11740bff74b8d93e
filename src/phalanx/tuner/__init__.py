"""Tuning phases that leave no trace: the LR range test (``lr_find``), the batch-size search
(``batch_size``) and the callbacks that run them when fit starts."""

from phalanx.tuner.batch_size_callback import BatchSizeFinder
from phalanx.tuner.lr_find import LRFinderResult, Tuner
from phalanx.tuner.lr_finder_callback import LearningRateFinder

__all__ = ["BatchSizeFinder", "LRFinderResult", "LearningRateFinder", "Tuner"]
