"""Metric loggers. Any object with ``log_metrics(metrics, step)`` works; these ship with phalanx under
Lightning's names."""

from phalanx.loggers.base import Logger
from phalanx.loggers.csv import CSVLogger
from phalanx.loggers.lit import LitLogger
from phalanx.loggers.mlflow import MLFlowLogger
from phalanx.loggers.tensorboard import TensorBoardLogger
from phalanx.loggers.wandb import WandbLogger

__all__ = ["CSVLogger", "LitLogger", "Logger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"]
