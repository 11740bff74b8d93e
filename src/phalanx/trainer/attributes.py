"""``TrainerAttributes``: what a Trainer holds and Lightning's public attributes over it, declared once.

The Trainer (:class:`phalanx.trainer.trainer.Trainer`) is this class plus its entry points
(``fit``/``validate``/``test``/``predict``). The seam is the package's import order: the loops
(:mod:`phalanx.trainer.loops`) and the checkpoint connector run on this class and the entry points call
them, so those modules import this one and the Trainer imports them, with no cycle.

What it holds, each with one owner: the frozen ``settings``; the ``loop_state`` (counters, saved in
checkpoints); the ``accumulation`` schedule the training loop reads per epoch; the ``logger_connector``
(what ``self.log`` records in each stage and what that publishes); the ``hooks`` dispatcher, which owns
the callbacks; the ``data`` connector (loaders and datamodule); and the set-up model and optimizers. Every
public attribute reads one of these: settings and data through :class:`~phalanx.trainer.settings.ReadOnly`,
counters and metrics through the loop state and the logger connector.

Code below the Trainer (the Module, callbacks) sees this class through
:class:`phalanx.core.view.TrainerView`; the Module's ``manual_backward``, ``toggle_optimizer`` and
``clip_gradients`` reach :mod:`phalanx.trainer.stepping` through the methods of that protocol here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from phalanx.core.accumulation import AccumulationSchedule
from phalanx.core.datamodule import DataModule
from phalanx.core.module import Module
from phalanx.core.optimizers import SchedulerConfig
from phalanx.core.toggling import Toggleable, untoggle_params
from phalanx.fabric.fabric import Fabric
from phalanx.profilers import Profiler
from phalanx.trainer import stepping
from phalanx.trainer.data_connector import DataConnector
from phalanx.trainer.hooks import HookDispatcher
from phalanx.trainer.logger_connector import LoggerConnector
from phalanx.trainer.loss_check import LossCheck
from phalanx.trainer.model_connector import ModelConnector
from phalanx.trainer.settings import ReadOnly, Settings
from phalanx.trainer.state import LoopState
from phalanx.trainer.stepping import StepOptimizer
from phalanx.utils.errors import MisconfigurationError


class TrainerAttributes:
    """The Trainer without its entry points (see the module docstring). Not meant to be built directly."""

    def __init__(self, settings: Settings, fabric: Fabric, callbacks: list[Any], profiler: Profiler) -> None:
        self.settings = settings
        self.fabric = fabric
        self.profiler = profiler
        self.loop_state = LoopState()  # one object for the Trainer's life: the step path holds it
        self.logger_connector = LoggerConnector(fabric, settings.log_every_n_steps)
        self.hooks = HookDispatcher(self, callbacks, settings, profiler, self.logger_connector.sync_step_metrics)
        self.accumulation = self._accumulation_schedule()
        self.window_losses: list[tuple[int, torch.Tensor]] = []  # the window's losses, checked before its step
        self.loss_check = LossCheck(torch.device("cpu"), 1, None)  # one per fit (loops.run_fit)
        self._resume: dict[str, Any] | None = None
        self.ckpt_path: str | None = None

        # What the current run works on.
        self.stage: str | None = None  # "fit", "validate", "test", "predict" (or "lr_find")
        self.current_stage: str | None = None  # the loop running now: "train", "validate", "test"
        self.sanity_checking = False
        self.interrupted = False
        self.model_connector = ModelConnector(self, fabric, settings.sync_batchnorm, self.loop_state, self.hooks)
        self.data = DataConnector(fabric, settings)

    # ------------------------------------------------------------------ the settings (Trainer arguments)
    max_epochs = ReadOnly[int]("settings")
    min_epochs = ReadOnly[int | None]("settings")
    max_steps = ReadOnly[int]("settings")
    min_steps = ReadOnly[int | None]("settings")
    limit_train_batches = ReadOnly[int | float]("settings")
    limit_val_batches = ReadOnly[int | float]("settings")
    limit_test_batches = ReadOnly[int | float]("settings")
    limit_predict_batches = ReadOnly[int | float]("settings")
    overfit_batches = ReadOnly[int | float]("settings")
    val_check_interval = ReadOnly[int | float]("settings")
    check_val_every_n_epoch = ReadOnly[int | None]("settings")
    num_sanity_val_steps = ReadOnly[int | float]("settings")
    log_every_n_steps = ReadOnly[int]("settings")
    fast_dev_run = ReadOnly[int]("settings")
    gradient_clip_val = ReadOnly[float | None]("settings")
    gradient_clip_algorithm = ReadOnly[str]("settings")
    deterministic = ReadOnly[bool | str | None]("settings")
    benchmark = ReadOnly[bool | None]("settings")
    inference_mode = ReadOnly[bool]("settings")
    use_distributed_sampler = ReadOnly[bool]("settings")
    sync_batchnorm = ReadOnly[bool]("settings")
    reload_dataloaders_every_n_epochs = ReadOnly[int]("settings")
    enable_autolog_hparams = ReadOnly[bool]("settings")
    barebones = ReadOnly[bool]("settings")
    default_root_dir = ReadOnly[Path]("settings")

    @property
    def accumulate_grad_batches(self) -> int:
        """Batches per optimizer step in the current epoch (:attr:`accumulation` at ``current_epoch``)."""
        return self.accumulation.at(self.loop_state.current_epoch)

    def _accumulation_schedule(self) -> AccumulationSchedule:
        """The schedule a callback supplies (``GradientAccumulationScheduler``), else the constant one of
        ``Trainer(accumulate_grad_batches=N)``; the two together, or two schedules, are refused."""
        supplied = [s for cb in self.callbacks if isinstance(s := getattr(cb, "accumulation_schedule", None),
                                                              AccumulationSchedule)]
        if len(supplied) > 1:
            raise MisconfigurationError("Two callbacks supply an accumulation schedule; keep one.")
        if supplied and self.settings.accumulate_grad_batches != 1:
            raise MisconfigurationError(
                "Pass accumulate_grad_batches through GradientAccumulationScheduler only, not also to the Trainer."
            )
        return supplied[0] if supplied else AccumulationSchedule(self.settings.accumulate_grad_batches)

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
        settings, state = self.settings, self.loop_state
        epochs_ok = settings.min_epochs is None or state.current_epoch >= settings.min_epochs
        steps_ok = settings.min_steps is None or state.global_step >= settings.min_steps
        return state.stop_requested and epochs_ok and steps_ok

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.loop_state.stop_requested = bool(value)

    @property
    def max_steps_reached(self) -> bool:
        return 0 <= self.settings.max_steps <= self.loop_state.global_step

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

    # ------------------------------------------------------------------ processes and devices
    @property
    def is_global_zero(self) -> bool:
        return self.fabric.is_global_zero

    @property
    def global_rank(self) -> int:
        return self.fabric.global_rank

    @property
    def local_rank(self) -> int:
        return self.fabric.local_rank

    @property
    def world_size(self) -> int:
        return self.fabric.world_size

    @property
    def device(self) -> torch.device:
        return self.fabric.device

    @property
    def loggers(self) -> list[Any]:
        return self.fabric.loggers

    @property
    def logger(self) -> Any:
        return self.fabric.logger

    @property
    def log_dir(self) -> Path:
        """The first logger's folder, or default_root_dir. Rank 0 decides and broadcasts it, so read
        it on every rank (it is a collective)."""
        logger = self.logger
        local = str(logger.log_dir if logger is not None and logger.log_dir is not None else self.default_root_dir)
        return Path(self.fabric.broadcast(local if self.is_global_zero else None))

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

    # ------------------------------------------------------------------ model, optimizers (the model connector)
    @property
    def module(self) -> Module:
        """The user's Module (``trainer.model`` is the set-up wrapper that runs its steps)."""
        return self.model_connector.attached()

    @property
    def lightning_module(self) -> Module:
        """Alias of ``trainer.module`` (eases porting)."""
        return self.module

    @property
    def model(self) -> Any:
        """The set-up module (the strategy's wrapper that runs the steps); None until a stage sets it up."""
        return self.model_connector.model

    @property
    def optimizers(self) -> list[Any]:
        """The set-up optimizers (torch optimizers), as ``configure_optimizers`` returned them."""
        return self.model_connector.optimizers

    @optimizers.setter
    def optimizers(self, value: list[Any]) -> None:
        self.model_connector.optimizers = list(value)

    @property
    def optimizer(self) -> Any:
        """The first set-up optimizer (None before fit)."""
        return self.optimizers[0] if self.optimizers else None

    @property
    def step_optimizers(self) -> list[StepOptimizer]:
        """What ``module.optimizers()`` returns: the optimizers whose ``step()`` counts a global step."""
        return self.model_connector.step_optimizers

    @property
    def lr_scheduler_configs(self) -> list[SchedulerConfig]:
        return self.model_connector.lr_scheduler_configs

    @lr_scheduler_configs.setter
    def lr_scheduler_configs(self, value: list[SchedulerConfig]) -> None:
        self.model_connector.lr_scheduler_configs = list(value)

    def setup_optimizers(self) -> None:
        """Call ``configure_optimizers`` again and set up what it returns (e.g. after the LR finder changed
        ``model.lr``)."""
        self.model_connector.setup_optimizers()

    def using_module(self, module: Module) -> contextlib.AbstractContextManager[None]:
        """Run ``module`` (e.g. a scratch copy) in place of the attached one inside the block; afterwards what was
        set up for it is released and the attached module and its optimizers are back (see
        :meth:`phalanx.trainer.model_connector.ModelConnector.using`)."""
        return self.model_connector.using(module)

    # ------------------------------------------------------------------ callbacks

    @property
    def callbacks(self) -> list[Any]:
        """The callbacks, in the order their hooks run (held by the hook dispatcher)."""
        return self.hooks.callbacks

    @callbacks.setter
    def callbacks(self, value: list[Any]) -> None:
        self.hooks.callbacks = value

    @property
    def checkpoint_callbacks(self) -> list[Any]:
        from phalanx.callbacks import ModelCheckpoint

        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> Any:
        cbs = self.checkpoint_callbacks
        return cbs[0] if cbs else None

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

    # ------------------------------------------------------------------ data (held by the data connector)
    datamodule = ReadOnly[DataModule | None]("data")
    train_dataloader = ReadOnly[Any]("data")
    train_sampler = ReadOnly[Any]("data")
    val_dataloaders = ReadOnly[list[Any]]("data")
    test_dataloaders = ReadOnly[list[Any]]("data")
    predict_dataloaders = ReadOnly[list[Any]]("data")
    num_training_batches = ReadOnly[int | None]("data")
    val_check_batches = ReadOnly[int | None]("data")
    num_eval_batches = ReadOnly[list[int | None]]("data")
    train_samples_per_batch = ReadOnly[int]("data")

    @property
    def estimated_stepping_batches(self) -> int:
        """Optimizer steps the fit will take (for schedulers such as OneCycleLR)."""
        if self.num_training_batches is None:
            if self.max_steps < 0:
                raise MisconfigurationError("The training data has no length; set max_steps to know the step count.")
            return self.max_steps
        per_epoch = math.ceil(self.num_training_batches / self.accumulate_grad_batches)
        total = per_epoch * self.max_epochs
        return min(total, self.max_steps) if self.max_steps >= 0 else total

    @property
    def enable_validation(self) -> bool:
        return bool(self.val_dataloaders) and self.limit_val_batches != 0

    @property
    def num_val_batches(self) -> list[int | float]:
        return self.data.counts(self.val_dataloaders, self.limit_val_batches)

    @property
    def num_sanity_val_batches(self) -> list[int | float]:
        return [min(n, self.num_sanity_val_steps) for n in self.num_val_batches]

    @property
    def num_test_batches(self) -> list[int | float]:
        return self.data.counts(self.test_dataloaders, self.limit_test_batches)

    @property
    def num_predict_batches(self) -> list[int | float]:
        return self.data.counts(self.predict_dataloaders, self.limit_predict_batches)

    @property
    def is_last_batch(self) -> bool:
        return self.num_training_batches is not None and self.batches_done >= self.num_training_batches

    # ------------------------------------------------------------------ metrics (held by the logger connector)
    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The latest step and epoch values, identical on every rank. Step values are synced across ranks
        only when something reads them, so reading this is a collective while some are pending: read it
        on every rank (phalanx syncs before each hook of your callbacks and Module, so reading it there,
        on any rank, is always free and safe)."""
        return self.logger_connector.callback_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        return self.logger_connector.progress_bar_metrics

    @property
    def logged_metrics(self) -> dict[str, float]:
        return self.logger_connector.logged_metrics

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.fabric.print(*args, **kwargs)

    def take_resume_state(self) -> dict[str, Any] | None:
        resume, self._resume = self._resume, None
        return resume

    def set_resume_state(self, state: dict[str, Any]) -> None:
        self._resume = state

    # ------------------------------------------------------------------ restore points (tuning phases)
    def capture_loop(self) -> Callable[[], None]:
        """The loops' own state now: counters, the running stage, published metrics and accumulators, the
        sampler position. Calling the result puts it back (``core.module_state.TrainerRestorePoint``)."""
        loop, stage = self.loop_state.restore_point(), self.current_stage
        restore_metrics = self.logger_connector.restore_point()
        sampler = self.train_sampler
        position = (sampler.epoch, sampler.skip) if sampler is not None else None

        def restore() -> None:
            self.loop_state.restore(loop)
            self.current_stage = stage
            restore_metrics()
            if position is not None:
                self.train_sampler.epoch, self.train_sampler.skip = position

        return restore

    # ------------------------------------------------------------------ the Module's step machinery
    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``Module.manual_backward``: the backward hooks around ``fabric.backward`` through the set-up model."""
        stepping.run_backward(self.fabric, self.model, self.hooks, loss, *args, **kwargs)

    def toggle_optimizer(self, module: Toggleable, optimizer: Any) -> None:
        """``Module.toggle_optimizer``: only ``optimizer``'s parameters require grad until untoggled."""
        stepping.toggle(self.optimizers, module, optimizer)

    def untoggle_optimizer(self, module: Toggleable) -> None:
        """``Module.untoggle_optimizer``."""
        untoggle_params(module)

    def clip_gradients(self, optimizer: Any, value: float | None, algorithm: str | None) -> None:
        """``Module.clip_gradients`` under the Trainer's clipping settings (see ``stepping.clip``)."""
        stepping.clip(self.settings, self.fabric, self.model, optimizer, value, algorithm)

    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Create the model directly on the device and in the precision's dtype."""
        with self.fabric.init_module(empty_init):
            yield
