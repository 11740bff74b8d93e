"""The Lightning-named views of a Trainer (``trainer.training``, ``num_val_batches``,
``early_stopping_callback``, ``max_epochs``, ``global_step``, ...), kept apart from the loop so the
Trainer's own files stay readable.

The failure this prevents: ported callbacks that read ``trainer.sanity_checking`` or
``trainer.num_val_batches`` and crash on an attribute error mid-fit. Each is derived from the
Trainer's state, never stored twice: the settings from the frozen :class:`~phalanx.trainer.settings.Settings`,
the counters from the :class:`~phalanx.trainer.state.LoopState`. (The loops themselves read those two
objects directly: a property here costs a Python call, and the step path runs per batch.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.trainer.data import num_batches

if TYPE_CHECKING:
    from phalanx.fabric.fabric import Fabric
    from phalanx.trainer.settings import Settings
    from phalanx.trainer.state import LoopState


class TrainerViews:
    """Mixed into :class:`phalanx.Trainer`; reads the attributes declared below."""

    fabric: Fabric
    settings: Settings
    loop_state: LoopState
    optimizers: list[Any]
    callbacks: list[Any]
    current_stage: str | None
    sanity_checking: bool
    val_dataloaders: list[Any]
    test_dataloaders: list[Any]
    predict_dataloaders: list[Any]
    num_training_batches: int | None

    # ------------------------------------------------------------------ the loop state
    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (each real step counts one, as in Lightning)."""
        return self.loop_state.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.loop_state.global_step = value

    @property
    def current_epoch(self) -> int:
        return self.loop_state.current_epoch

    @current_epoch.setter
    def current_epoch(self, value: int) -> None:
        self.loop_state.current_epoch = value

    @property
    def batches_done(self) -> int:
        """Training batches finished in the current epoch."""
        return self.loop_state.batches_done

    @batches_done.setter
    def batches_done(self, value: int) -> None:
        self.loop_state.batches_done = value

    @property
    def in_window(self) -> bool:
        """Inside a gradient-accumulation window (a checkpoint taken now would lose its gradients)."""
        return self.loop_state.in_window

    @property
    def epoch_finished(self) -> bool:
        return self.loop_state.epoch_finished

    @property
    def should_stop(self) -> bool:
        """Set it to True to stop after the current optimizer step. A request made before ``min_epochs``
        / ``min_steps`` are reached waits until they are."""
        return self.loop_state.stop_requested and self._minimum_reached()

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.loop_state.stop_requested = bool(value)

    # ------------------------------------------------------------------ the settings (Trainer arguments)
    @property
    def max_epochs(self) -> int:
        return self.settings.max_epochs

    @property
    def min_epochs(self) -> int | None:
        return self.settings.min_epochs

    @property
    def max_steps(self) -> int:
        return self.settings.max_steps

    @property
    def min_steps(self) -> int | None:
        return self.settings.min_steps

    @property
    def limit_train_batches(self) -> int | float:
        return self.settings.limit_train_batches

    @property
    def limit_val_batches(self) -> int | float:
        return self.settings.limit_val_batches

    @property
    def limit_test_batches(self) -> int | float:
        return self.settings.limit_test_batches

    @property
    def limit_predict_batches(self) -> int | float:
        return self.settings.limit_predict_batches

    @property
    def overfit_batches(self) -> int | float:
        return self.settings.overfit_batches

    @property
    def val_check_interval(self) -> int | float:
        return self.settings.val_check_interval

    @property
    def check_val_every_n_epoch(self) -> int | None:
        return self.settings.check_val_every_n_epoch

    @property
    def num_sanity_val_steps(self) -> int | float:
        return self.settings.num_sanity_val_steps

    @property
    def log_every_n_steps(self) -> int:
        return self.settings.log_every_n_steps

    @property
    def fast_dev_run(self) -> int:
        return self.settings.fast_dev_run

    @property
    def gradient_clip_val(self) -> float | None:
        return self.settings.gradient_clip_val

    @property
    def gradient_clip_algorithm(self) -> str:
        return self.settings.gradient_clip_algorithm

    @property
    def deterministic(self) -> bool | str | None:
        return self.settings.deterministic

    @property
    def benchmark(self) -> bool | None:
        return self.settings.benchmark

    @property
    def inference_mode(self) -> bool:
        return self.settings.inference_mode

    @property
    def use_distributed_sampler(self) -> bool:
        return self.settings.use_distributed_sampler

    @property
    def sync_batchnorm(self) -> bool:
        return self.settings.sync_batchnorm

    @property
    def reload_dataloaders_every_n_epochs(self) -> int:
        return self.settings.reload_dataloaders_every_n_epochs

    @property
    def enable_autolog_hparams(self) -> bool:
        return self.settings.enable_autolog_hparams

    @property
    def barebones(self) -> bool:
        return self.settings.barebones

    @property
    def default_root_dir(self) -> Path:
        return self.settings.default_root_dir

    # ------------------------------------------------------------------ derived
    @property
    def optimizer(self) -> Any:
        """The first set-up optimizer (None before fit)."""
        return self.optimizers[0] if self.optimizers else None

    def _minimum_reached(self) -> bool:
        """``min_epochs`` and ``min_steps`` are met (a stop request waits for them)."""
        settings, state = self.settings, self.loop_state
        epochs_ok = settings.min_epochs is None or state.current_epoch >= settings.min_epochs
        steps_ok = settings.min_steps is None or state.global_step >= settings.min_steps
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

