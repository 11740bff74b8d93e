"""The loggers and callbacks a Trainer's arguments add (``logger=True``, ``enable_progress_bar``,
``enable_model_summary``, ``enable_checkpointing``, ``max_time``), and the order callbacks run in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phalanx.trainer.settings import Settings
from phalanx.utils.errors import MisconfigurationError


def make_loggers(logger: Any, root_dir: Path) -> list[Any]:
    """``Trainer(logger=...)``: True (a CSVLogger under ``root_dir``), False/None, a logger or a list."""
    if logger is True:
        from phalanx.loggers import CSVLogger

        return [CSVLogger(root_dir=root_dir, name="phalanx_logs")]
    if logger is False or logger is None:
        return []
    return list(logger) if isinstance(logger, (list, tuple)) else [logger]  # Fabric checks each is a Logger


def make_callbacks(callbacks: Any, settings: Settings, max_time: Any) -> list[Any]:
    """The callbacks given plus the defaults the settings ask for (a progress bar, a model summary, a
    Timer for ``max_time``, a ModelCheckpoint), in :func:`ordered` order."""
    from phalanx.callbacks import ModelCheckpoint, ProgressBar
    from phalanx.callbacks.model_summary import ModelSummary
    from phalanx.callbacks.timer import Timer

    given = list(callbacks) if isinstance(callbacks, (list, tuple)) else ([] if callbacks is None else [callbacks])
    if settings.enable_progress_bar and not any(isinstance(c, ProgressBar) for c in given):
        given.insert(0, ProgressBar())  # first: it closes its bar before other callbacks print
    if settings.enable_model_summary and not any(isinstance(c, ModelSummary) for c in given):
        given.append(ModelSummary())
    if max_time is not None:
        if any(isinstance(c, Timer) for c in given):
            raise MisconfigurationError("Pass max_time= or a Timer callback, not both.")
        given.append(Timer(duration=max_time))
    if settings.enable_checkpointing and not any(isinstance(c, ModelCheckpoint) for c in given):
        given.append(ModelCheckpoint())
    return ordered(given)


def ordered(callbacks: list[Any]) -> list[Any]:
    """Checkpoint callbacks last, so what they save includes every other callback's update of a hook."""
    from phalanx.callbacks import ModelCheckpoint

    checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    return [c for c in callbacks if not isinstance(c, ModelCheckpoint)] + checkpoints
