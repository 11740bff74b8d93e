"""Metrics to TensorBoard event files (tensorboard is imported only when this logger is used)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.loggers.base import flatten_hparams, log_dir_of
from phalanx.utils.tensors import optional_module

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class TensorBoardLogger:
    """Writes event files to ``<root_dir>/<name>/version_<n>/``."""

    def __init__(
        self, root_dir: str | Path = "logs", name: str = "phalanx", version: int | str | None = None, *,
        save_dir: str | Path | None = None, prefix: str = "", sub_dir: str | Path | None = None,
    ) -> None:
        # save_dir: Lightning's name for root_dir. prefix: "<prefix>-<name>" metric names; sub_dir: a folder
        # inside the version folder for the event files.
        root_dir = save_dir if save_dir is not None else root_dir
        self._prefix, self._sub_dir = prefix, sub_dir
        self._root, self._name, self._version_given = Path(root_dir), name, version
        self._log_dir: Path | None = None
        self._writer: SummaryWriter | None = None

    @property
    def root_dir(self) -> Path:
        """The folder holding ``<name>/version_<n>`` (Lightning's name); a Fabric's run logs go there too."""
        return self._root

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            self._log_dir = log_dir_of(self._root, self._name, self._version_given)
            if self._sub_dir is not None:
                self._log_dir = self._log_dir / self._sub_dir
        return self._log_dir

    @property
    def experiment(self) -> SummaryWriter:
        """The ``SummaryWriter`` (created on first use)."""
        if self._writer is None:
            board = optional_module("torch.utils.tensorboard", "TensorBoardLogger", "tensorboard", "tensorboard")
            self._writer = board.SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def log_hyperparams(self, params: dict[str, Any]) -> None:
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
