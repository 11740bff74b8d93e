"""The user's code as the Trainer sees it: ``Module`` and ``DataModule`` with Lightning's hooks,
``save_hyperparameters``, loading from checkpoints, and snapshots of everything a module holds. Code
here talks to a Trainer only through the :class:`~phalanx.core.view.TrainerView` protocol."""

from phalanx.core.datamodule import DataModule
from phalanx.core.module import Module
from phalanx.core.view import TrainerView

__all__ = ["DataModule", "Module", "TrainerView"]
