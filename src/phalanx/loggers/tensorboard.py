"""Metrics to TensorBoard event files (tensorboard is imported only when this logger is used)."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.loggers.base import FolderLogger, flatten_hparams
from phalanx.utils.tensors import optional_module

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class TensorBoardLogger(FolderLogger):
    """Writes event files to ``<root_dir>/<name>/version_<n>/``."""

    def __init__(
        self, root_dir: str | Path = "logs", name: str = "phalanx", version: int | str | None = None, *,
        save_dir: str | Path | None = None, prefix: str = "", sub_dir: str | Path | None = None,
    ) -> None:
        # save_dir: Lightning's name for root_dir. prefix: "<prefix>-<name>" metric names; sub_dir: a folder
        # inside the version folder for the event files.
        root_dir = save_dir if save_dir is not None else root_dir
        super().__init__(root_dir, name, version, sub_dir)
        self._prefix = prefix
        self._writer: SummaryWriter | None = None

    @property
    def experiment(self) -> SummaryWriter:
        """The ``SummaryWriter`` (created on first use)."""
        if self._writer is None:
            board = optional_module("torch.utils.tensorboard", "TensorBoardLogger", "tensorboard", "tensorboard")
            self._writer = board.SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        flat = flatten_hparams(params)
        self.experiment.add_text("hparams", "\n".join(f"{k}: {v}" for k, v in flat.items()))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.experiment.add_scalar(f"{self._prefix}-{key}" if self._prefix else key, value, global_step=step)

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str = "success") -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
