"""The logger contract: ``Logger``, a base class whose methods do nothing until a logger overrides them.

Lightning's names and signatures (``lightning.fabric.loggers.Logger`` with the Trainer's additions from
``lightning.pytorch.loggers.Logger``). A logger implements ``log_metrics`` and whatever else its backend
does; who calls what, and when, is written once, in Fabric's ``Logging`` (``phalanx.fabric.logging``): every
call on global rank 0 only, ``log_hyperparams`` when a fit starts, ``after_save_checkpoint`` after each
checkpoint a ``ModelCheckpoint`` writes, ``finalize`` at the end of each Trainer stage and when the job ends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from argparse import Namespace
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from phalanx.distributed.launch import restart_count


class Logger(ABC):
    """Base class of every logger (see the module docstring). Only ``log_metrics`` must be written."""

    @property
    def name(self) -> str | None:
        """The experiment's name (None: the backend has none)."""
        return None

    @property
    def version(self) -> int | str | None:
        """The experiment's version (None: the backend has none)."""
        return None

    @property
    def root_dir(self) -> str | Path | None:
        """The folder holding every version of the experiment; None if the logger writes nothing locally."""
        return None

    @property
    def log_dir(self) -> str | Path | None:
        """The folder this version writes to; None if the logger writes nothing locally."""
        return None

    @property
    def save_dir(self) -> str | Path | None:
        """Where the logs are saved (the Trainer's name for ``root_dir``); None if nowhere locally."""
        return None

    @property
    def group_separator(self) -> str:
        """What joins the parts of a grouped metric name (``train/loss``)."""
        return "/"

    @property
    def experiment(self) -> Any:
        """The backend's own object (a ``SummaryWriter``, a wandb run, ...), None if it has none."""
        return None

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record ``metrics`` (name -> value) at ``step``."""

    # The methods below do nothing unless a logger overrides them: defaults, not forgotten abstract methods.
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:  # noqa: B027
        """Record the run's hyperparameters."""

    def log_graph(self, model: nn.Module, input_array: Tensor | None = None) -> None:  # noqa: B027
        """Record the model's graph."""

    def save(self) -> None:  # noqa: B027
        """Write out what is buffered."""

    def finalize(self, status: str = "success") -> None:
        """End the experiment's run (``status``: "success" or "failed"); it may be used again afterwards (a
        Trainer's next stage). By default: ``save``."""
        self.save()

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:  # noqa: B027
        """Called after a ``ModelCheckpoint`` wrote a checkpoint (with that callback)."""


def next_version(root: Path, name: str) -> int:
    """The first unused ``version_N`` under ``root/name``; on a restarted attempt of the job (torch's
    elastic agent restarted its processes) the newest one, so the run goes on logging where it was."""
    base = root / name
    if not base.is_dir():
        return 0
    versions = [int(p.name.split("_")[1]) for p in base.glob("version_*") if p.name.split("_")[1].isdigit()]
    if versions and restart_count() > 0:
        return max(versions)
    return max(versions, default=-1) + 1


def version_of(root: Path, name: str, log_dir: Path) -> int | str:
    """The version ``log_dir`` (``root/name/<version folder>[/...]``) belongs to: N for ``version_N``, else the
    folder's name."""
    folder = log_dir.relative_to(root / name).parts[0]
    number = folder.removeprefix("version_")
    return int(number) if folder.startswith("version_") and number.isdigit() else folder


def log_dir_of(root: str | Path, name: str, version: int | str | None) -> Path:
    root = Path(root)
    if version is None:
        version = next_version(root, name)
    folder = version if isinstance(version, str) else f"version_{version}"
    return root / name / folder


class FolderLogger(Logger):
    """A logger writing files under ``<root_dir>/<name>/version_<n>`` (or ``<name>/<version>`` for a string
    version; ``/<sub_dir>`` below it if given). The folder is resolved on first use, so only the rank that logs
    (rank 0) creates it."""

    def __init__(self, root_dir: str | Path, name: str, version: int | str | None,
                 sub_dir: str | Path | None = None) -> None:
        self._root, self._name, self._version_given, self._sub_dir = Path(root_dir), name, version, sub_dir
        self._log_dir: Path | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        return version_of(self._root, self._name, self.log_dir) if self._version_given is None else self._version_given

    @property
    def root_dir(self) -> Path:
        """The folder holding ``<name>/version_<n>`` (Lightning's name); a Fabric's run logs go there too."""
        return self._root

    @property
    def save_dir(self) -> Path:
        return self._root

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            folder = log_dir_of(self._root, self._name, self._version_given)
            self._log_dir = folder / self._sub_dir if self._sub_dir is not None else folder
        return self._log_dir


def flatten_hparams(params: dict[str, Any] | Namespace, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (vars(params) if isinstance(params, Namespace) else params).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_hparams(v, key + "/"))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
