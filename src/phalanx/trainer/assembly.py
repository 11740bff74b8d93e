"""What a Trainer is assembled from: its default loggers and callbacks, in their order, and the
global torch flags one run applies (``deterministic``/``benchmark``).

Kept apart from the Trainer's class because these are decisions about the *arguments* (which
callbacks ``enable_progress_bar``/``enable_checkpointing``/``max_time`` add, where the CSV logger
writes), made once at construction or once per run, never inside a loop.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from phalanx.trainer.settings import Settings
from phalanx.utils.errors import MisconfigurationError


def make_loggers(logger: Any, root_dir: Path) -> list[Any]:
    """``Trainer(logger=...)``: True (a CSVLogger under ``root_dir``), False/None, a logger or a list."""
    if logger is True:
        from phalanx.loggers import CSVLogger

        return [CSVLogger(root_dir=root_dir, name="phalanx_logs")]
    if logger is False or logger is None:
        return []
    loggers = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    for lg in loggers:
        if not callable(getattr(lg, "log_metrics", None)):
            raise MisconfigurationError(f"logger {lg!r} has no log_metrics(metrics, step) method.")
    return loggers


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


@contextlib.contextmanager
def deterministic(mode: bool | str | None, benchmark: bool | None) -> Iterator[None]:
    """torch's deterministic mode (``mode`` True or "warn") and cudnn's ``benchmark`` for one run, then the
    process's previous settings: they are global, and another Trainer or later code must not inherit them."""
    if not mode and benchmark is None:
        yield
        return
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn_benchmark, cublas = torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if mode:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS needs it
        torch.use_deterministic_algorithms(True, warn_only=mode == "warn")
    torch.backends.cudnn.benchmark = bool(benchmark) if benchmark is not None else (
        False if mode else cudnn_benchmark)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.backends.cudnn.benchmark = cudnn_benchmark
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
