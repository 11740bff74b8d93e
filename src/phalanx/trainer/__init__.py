"""The managed training loop: ``phalanx.Trainer``, ``phalanx.Module``, ``phalanx.DataModule``."""

from phalanx.core.module import DataModule, Module
from phalanx.trainer.trainer import Trainer

__all__ = ["DataModule", "Module", "Trainer"]
