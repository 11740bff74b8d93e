"""``phalanx.DataModule`` (Lightning's LightningDataModule): the data of a task in one object.

A class of its own, apart from the Module: it shares only the hyperparameter handling, and the
Trainer asks it for loaders before the module's own (see ``Trainer.fit``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.core.hooks import DataHooks
from phalanx.core.hparams import HyperparametersMixin
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.view import TrainerView


class DataModule(HyperparametersMixin, DataHooks):
    """Optional: the data of a task in one object. Override the loaders you need.

    ``phalanx.LightningDataModule`` is this class."""

    name: str | None = None
    CHECKPOINT_HYPER_PARAMS_KEY = "datamodule_hyper_parameters"
    CHECKPOINT_HYPER_PARAMS_NAME = "datamodule_hparams_name"
    CHECKPOINT_HYPER_PARAMS_TYPE = "datamodule_hparams_type"

    def __init__(self) -> None:
        self.trainer: TrainerView | None = None
        self.prepare_data_per_node = True

    def prepare_data(self) -> None:
        """Download or write files. Runs on local rank 0 of each node (or global rank 0 with
        ``prepare_data_per_node = False``), before the others call setup."""

    def setup(self, stage: str) -> None:
        """Build datasets; runs on every rank."""

    def teardown(self, stage: str) -> None: ...

    def train_dataloader(self) -> Any:
        raise MisconfigurationError(f"{type(self).__name__} does not implement train_dataloader().")

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        raise MisconfigurationError(f"{type(self).__name__} does not implement test_dataloader().")

    def predict_dataloader(self) -> Any:
        raise MisconfigurationError(f"{type(self).__name__} does not implement predict_dataloader().")

    def on_exception(self, exception: BaseException) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    @classmethod
    def from_datasets(
        cls,
        train_dataset: Any = None,
        val_dataset: Any = None,
        test_dataset: Any = None,
        predict_dataset: Any = None,
        batch_size: int = 1,
        num_workers: int = 0,
        **datamodule_kwargs: Any,
    ) -> DataModule:
        """A DataModule whose loaders wrap the given datasets (training shuffled, the others in order)."""
        from phalanx.core.loading import datamodule_from_datasets

        made: DataModule = datamodule_from_datasets(cls, train_dataset, val_dataset, test_dataset, predict_dataset,
                                                    batch_size, num_workers, datamodule_kwargs)
        return made

    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: str | Path, map_location: Any = None, hparams_file: str | Path | None = None,
        weights_only: bool | None = None, **kwargs: Any,
    ) -> Any:
        """A new ``cls(**saved datamodule hyperparameters, **kwargs)`` from a Trainer checkpoint."""
        from phalanx.core.loading import load_datamodule

        return load_datamodule(cls, checkpoint_path, hparams_file, weights_only, kwargs)
