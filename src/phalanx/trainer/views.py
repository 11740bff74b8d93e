"""The Lightning-named, read-only views of a Trainer (``trainer.training``, ``num_val_batches``,
``early_stopping_callback``, ...), kept apart from the loop so trainer.py stays readable.

The failure this prevents: ported callbacks that read ``trainer.sanity_checking`` or
``trainer.num_val_batches`` and crash on an attribute error mid-fit. Each is derived from the
Trainer's state, never stored twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from phalanx.trainer.data import num_batches

if TYPE_CHECKING:
    from phalanx.fabric.fabric import Fabric


class TrainerViews:
    """Mixed into :class:`phalanx.Trainer`; reads the attributes declared below."""

    fabric: Fabric
    optimizers: list[Any]
    callbacks: list[Any]
    current_stage: str | None
    sanity_checking: bool
    val_dataloaders: list[Any]
    test_dataloaders: list[Any]
    predict_dataloaders: list[Any]
    limit_val_batches: int | float
    limit_test_batches: int | float
    limit_predict_batches: int | float
    num_sanity_val_steps: int | float
    num_training_batches: int | None
    batches_done: int
    min_epochs: int | None
    min_steps: int | None
    current_epoch: int
    global_step: int
    _should_stop: bool

    @property
    def optimizer(self) -> Any:
        """The first set-up optimizer (None before fit)."""
        return self.optimizers[0] if self.optimizers else None

    @property
    def should_stop(self) -> bool:
        """Set it to True to stop after the current optimizer step. A request made before ``min_epochs``
        / ``min_steps`` are reached waits until they are."""
        return self._should_stop and self._minimum_reached()

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._should_stop = bool(value)

    def _minimum_reached(self) -> bool:
        epochs_ok = self.min_epochs is None or self.current_epoch >= self.min_epochs
        steps_ok = self.min_steps is None or self.global_step >= self.min_steps
        return epochs_ok and steps_ok

    @property
    def strategy(self) -> Any:
        return self.fabric.strategy

    @property
    def precision(self) -> str:
        """The precision's name, e.g. ``"32-true"`` or ``"bf16-mixed"``."""
        return str(self.fabric.strategy.precision.name)

    @property
    def num_devices(self) -> int:
        return int(self.fabric.strategy.devices)

    @property
    def num_nodes(self) -> int:
        return int(self.fabric.strategy.num_nodes)

    @property
    def node_rank(self) -> int:
        return self.fabric.node_rank

    @property
    def device_ids(self) -> list[int]:
        """Device indices this node uses (one per process)."""
        return list(range(self.num_devices))

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        return self.fabric.strategy.distributed_sampler_kwargs()

    @property
    def training(self) -> bool:
        return self.current_stage == "train"

    @property
    def validating(self) -> bool:
        return self.current_stage == "validate" and not self.sanity_checking

    @property
    def testing(self) -> bool:
        return self.current_stage == "test"

    @property
    def predicting(self) -> bool:
        return self.current_stage == "predict"

    @property
    def evaluating(self) -> bool:
        return self.current_stage in ("validate", "test")

    @property
    def enable_validation(self) -> bool:
        return bool(self.val_dataloaders) and self.limit_val_batches != 0

    @property
    def num_val_batches(self) -> list[int | float]:
        return [n if n is not None else float("inf") for n in
                (num_batches(loader, self.limit_val_batches) for loader in self.val_dataloaders)]

    @property
    def num_sanity_val_batches(self) -> list[int | float]:
        return [min(n, self.num_sanity_val_steps) for n in self.num_val_batches]

    @property
    def num_test_batches(self) -> list[int | float]:
        return [n if n is not None else float("inf") for n in
                (num_batches(loader, self.limit_test_batches) for loader in self.test_dataloaders)]

    @property
    def num_predict_batches(self) -> list[int | float]:
        return [n if n is not None else float("inf") for n in
                (num_batches(loader, self.limit_predict_batches) for loader in self.predict_dataloaders)]

    @property
    def is_last_batch(self) -> bool:
        return self.num_training_batches is not None and self.batches_done >= self.num_training_batches

    @property
    def early_stopping_callbacks(self) -> list[Any]:
        from phalanx.callbacks import EarlyStopping

        return [c for c in self.callbacks if isinstance(c, EarlyStopping)]

    @property
    def early_stopping_callback(self) -> Any:
        cbs = self.early_stopping_callbacks
        return cbs[0] if cbs else None

    @property
    def progress_bar_callback(self) -> Any:
        from phalanx.callbacks import ProgressBar

        return next((c for c in self.callbacks if isinstance(c, ProgressBar)), None)

    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Create the model directly on the device and in the precision's dtype."""
        with self.fabric.init_module(empty_init):
            yield

