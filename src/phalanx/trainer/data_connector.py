"""``DataConnector``: the Trainer's data, from the loaders it was given (or the DataModule's, or the
Module's own) to the set-up loaders, the training sampler whose position a checkpoint saves, and the
batch counts the limits allow. The samplers themselves are :mod:`phalanx.trainer.loaders`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx.core.module import overrides
from phalanx.trainer.loaders import as_list, num_batches, prepare_eval_loader, prepare_train_loader
from phalanx.trainer.settings import sequential
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.datamodule import DataModule
    from phalanx.core.module import Module
    from phalanx.fabric.fabric import Fabric
    from phalanx.trainer.settings import Settings


class DataConnector:
    """Owns the loaders of every stage (``trainer.train_dataloader``, ``trainer.val_dataloaders``, ... read
    them) and ``datamodule``. A loader is taken from what the entry point was given, else the datamodule's
    ``*_dataloader()``, else the Module's."""

    def __init__(self, fabric: Fabric, settings: Settings) -> None:
        self.fabric, self.settings = fabric, settings
        self.datamodule: DataModule | None = None
        self.train_dataloader: Any = None
        self.train_sampler: Any = None  # the Trainer's TrainSampler (None: the user's own sampler)
        self.val_dataloaders: list[Any] = []
        self.test_dataloaders: list[Any] = []
        self.predict_dataloaders: list[Any] = []
        self.num_training_batches: int | None = None
        self.val_check_batches: int | None = None  # validate every this many training batches (None: at epoch end)
        self.num_eval_batches: list[int | None] = []  # per loader, of the evaluation running now
        self._train_source: Any = None  # what fit was given, to rebuild loaders on reload
        self._val_source: Any = None

    def source(self, given: Any, getter: str, module: Module | None) -> Any:
        """Loaders: those given, else the datamodule's, else ``module``'s own ``getter()``."""
        if given is not None:
            return given
        if self.datamodule is not None and overrides(self.datamodule, getter):
            return getattr(self.datamodule, getter)()
        if module is not None and overrides(module, getter):
            return getattr(module, getter)()
        if self.datamodule is not None and getter == "train_dataloader":
            return self.datamodule.train_dataloader()  # raises what is missing
        return None

    def eval_loaders(self, dataloaders: Any, getter: str, module: Module | None) -> list[Any]:
        """The set-up evaluation loaders of ``dataloaders`` (or of ``getter``, see :meth:`source`)."""
        loaders = as_list(self.source(dataloaders, getter, module))
        return [prepare_eval_loader(loader, self.fabric, self.settings.use_distributed_sampler) for loader in loaders]

    def set_fit_sources(self, train_dataloaders: Any, val_dataloaders: Any) -> None:
        self._train_source, self._val_source = train_dataloaders, val_dataloaders

    def prepare_train(self, module: Module | None) -> None:
        """Set up the training and validation loaders of the fit (again, on a reload)."""
        settings = self.settings
        train = self.source(self._train_source, "train_dataloader", module)
        if train is None:
            raise MisconfigurationError(
                "trainer.fit() needs training data: pass train_dataloaders= or datamodule=, or implement the "
                "module's train_dataloader()."
            )
        if settings.overfit_batches:
            train = sequential(train)
        self.train_dataloader, self.train_sampler = prepare_train_loader(train, self.fabric,
                                                                         settings.use_distributed_sampler)
        no_val = settings.limit_val_batches == 0
        self.val_dataloaders = [] if no_val else self.eval_loaders(self._val_source, "val_dataloader", module)
        self.num_training_batches = num_batches(self.train_dataloader, settings.limit_train_batches)
        self.val_check_batches = self._val_check_batches()

    def reload_if_due(self, epoch: int, batches_done: int, module: Module | None) -> None:
        """``reload_dataloaders_every_n_epochs``: at the start of every n-th epoch, call the loader methods
        again (the first epoch uses the loaders prepared for fit)."""
        n = self.settings.reload_dataloaders_every_n_epochs
        if n and epoch > 0 and epoch % n == 0 and batches_done == 0:
            self.prepare_train(module)

    def _val_check_batches(self) -> int | None:
        interval = self.settings.val_check_interval
        if isinstance(interval, float):
            if interval >= 1.0:
                return None
            if self.num_training_batches is None:
                raise MisconfigurationError(
                    "val_check_interval as a fraction needs training data with a length; pass an int (batches)."
                )
            return max(1, int(self.num_training_batches * interval))
        return interval if interval > 0 else None

    @property
    def train_samples_per_batch(self) -> int:
        """Global samples consumed per training batch (all ranks), for resuming the sampler."""
        if self.train_sampler is None or self.train_dataloader is None:
            return 0
        return int(self.train_dataloader.batch_size or 1) * int(self.train_sampler.num_replicas)

    @staticmethod
    def counts(loaders: list[Any], limit: int | float) -> list[int | float]:
        """Batches per loader under ``limit`` (inf for a loader without a length)."""
        return [n if n is not None else float("inf") for n in (num_batches(loader, limit) for loader in loaders)]
