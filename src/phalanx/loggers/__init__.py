"""Metric loggers. Any object with ``log_metrics(metrics, step)`` works; these two ship with phalanx."""

from phalanx.loggers.base import Logger
from phalanx.loggers.csv import CSVLogger
from phalanx.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]
