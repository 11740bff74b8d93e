"""Metric loggers under Lightning's names. Every logger subclasses :class:`Logger` (``phalanx.loggers.base``),
whose methods do nothing until overridden: a new logger is one file with its subclass (``log_metrics`` and what
its backend does), plus its name here. Fabric's ``Logging`` (``phalanx.fabric.logging``) is what calls them.
``LitLogger`` is no logger: constructing it is refused, naming the alternatives."""

from phalanx.loggers.base import Logger
from phalanx.loggers.csv import CSVLogger
from phalanx.loggers.lit import LitLogger
from phalanx.loggers.mlflow import MLFlowLogger
from phalanx.loggers.tensorboard import TensorBoardLogger
from phalanx.loggers.wandb import WandbLogger

__all__ = ["CSVLogger", "LitLogger", "Logger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"]
