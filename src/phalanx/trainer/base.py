"""``TrainerBase``: what a Trainer holds and shows, and how it prepares a run; everything but the
entry points (``fit``/``validate``/``test``/``predict``, in :mod:`phalanx.trainer.trainer`).

The seam is the package's import order: the loops (:mod:`phalanx.trainer.loops`) and the checkpoint
code (:mod:`phalanx.trainer.checkpointing`) run on this class, and the entry points call them, so
those modules import this one and the Trainer imports them, with no cycle. The state lives in three
objects: the frozen ``settings``, the ``loop_state`` (counters, saved in checkpoints) and the run's
working set below (the set-up model, optimizers, loaders, metrics).

Code below the Trainer (the Module, callbacks, snapshots) sees this class through
:class:`phalanx.core.view.TrainerView`; the step machinery of the Module's ``manual_backward``,
``toggle_optimizer`` and ``clip_gradients`` is reached through the methods of that protocol here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.core.accumulation import AccumulationSchedule
from phalanx.core.datamodule import DataModule
from phalanx.core.module import Module, no_op_hooks, overrides
from phalanx.core.toggling import Toggleable, untoggle_params
from phalanx.fabric.fabric import Fabric
from phalanx.profilers import Profiler
from phalanx.trainer import stepping
from phalanx.trainer.assembly import deterministic, ordered
from phalanx.trainer.board import MetricBoard
from phalanx.trainer.data import as_list, num_batches, prepare_eval_loader, prepare_train_loader
from phalanx.trainer.hooks import TrainerHooks
from phalanx.trainer.loss_check import LossCheck
from phalanx.trainer.optim import SchedulerConfig, parse_all_optimizers
from phalanx.trainer.results import Results
from phalanx.trainer.settings import Settings, sequential
from phalanx.trainer.state import LoopState
from phalanx.trainer.stepping import StepOptimizer, StepPlan
from phalanx.trainer.views import TrainerViews
from phalanx.utils.errors import MisconfigurationError

STAGES = ("train", "validate", "test")  # the stages that log metrics (each has its Results)


class TrainerBase(TrainerViews, TrainerHooks):
    """The Trainer without its entry points (see the module docstring). Not meant to be built directly."""

    def __init__(self, settings: Settings, fabric: Fabric, callbacks: list[Any], profiler: Profiler) -> None:
        self.settings = settings
        self.fabric = fabric
        self.callbacks = callbacks
        self.profiler = profiler
        self.accumulation = self._accumulation_schedule()

        # Loop state (saved in checkpoints). One object for the Trainer's life: the step path holds it.
        self.loop_state = LoopState()
        self._hook_methods: dict[str, tuple[tuple[Any, ...], list[tuple[Any, Any]]]] = {}
        self._no_op_hooks = no_op_hooks()
        self.window_losses: list[tuple[int, torch.Tensor]] = []  # the window's losses, checked before its step
        self.loss_check = LossCheck(torch.device("cpu"), 1, None)  # one per fit (loops.run_fit)
        self.step_plan: StepPlan | None = None  # what a training batch calls, decided per epoch (loops.py)
        self._resume: dict[str, Any] | None = None
        self.ckpt_path: str | None = None

        # What the current run works on.
        self.stage: str | None = None  # "fit", "validate", "test", "predict" (or "lr_find")
        self.current_stage: str | None = None  # the loop running now: "train", "validate", "test"
        self.sanity_checking = False
        self.interrupted = False
        self._module: Module | None = None
        self.model: Any = None  # the set-up (wrapped) module
        self.optimizers: list[Any] = []  # set-up optimizers (torch.optim.Optimizer instances)
        self.step_optimizers: list[StepOptimizer] = []  # what module.optimizers() returns
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.datamodule: DataModule | None = None
        self.train_dataloader: Any = None
        self.train_sampler: Any = None
        self.val_dataloaders: list[Any] = []
        self.test_dataloaders: list[Any] = []
        self.predict_dataloaders: list[Any] = []
        self._train_source: Any = None  # what fit was given, to rebuild loaders on reload
        self._val_source: Any = None
        self.num_training_batches: int | None = None
        self.val_check_batches: int | None = None
        self.num_eval_batches: list[int | None] = []  # per loader, of the evaluation running now
        self.results: dict[str, Results] = {s: Results(s, self.fabric.device) for s in STAGES}
        self.metric_board = MetricBoard()

    # ------------------------------------------------------------------ properties
    @property
    def module(self) -> Module:
        """The user's Module (``trainer.model`` is the set-up wrapper that runs its steps)."""
        if self._module is None:
            raise MisconfigurationError("The Trainer has no model yet: call fit/validate/test/predict with one.")
        return self._module

    @property
    def lightning_module(self) -> Module:
        """Alias of ``trainer.module`` (eases porting)."""
        return self.module

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
        local = str(logger.log_dir) if logger is not None and hasattr(logger, "log_dir") else str(self.default_root_dir)
        return Path(self.fabric.broadcast(local if self.is_global_zero else None))

    @property
    def checkpoint_callbacks(self) -> list[Any]:
        from phalanx.callbacks import ModelCheckpoint

        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> Any:
        cbs = self.checkpoint_callbacks
        return cbs[0] if cbs else None

    @property
    def max_steps_reached(self) -> bool:
        return 0 <= self.settings.max_steps <= self.loop_state.global_step

    @property
    def train_samples_per_batch(self) -> int:
        """Global samples consumed per training batch (all ranks), for resuming the sampler."""
        if self.train_sampler is None or self.train_dataloader is None:
            return 0
        return int(self.train_dataloader.batch_size or 1) * int(self.train_sampler.num_replicas)

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

    # ------------------------------------------------------------------ metrics (used by loops)
    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The latest step and epoch values, identical on every rank. Step values are synced across ranks
        only when something reads them, so reading this is a collective while some are pending: read it
        on every rank (phalanx syncs before each hook of your callbacks and Module, so reading it there,
        on any rank, is always free and safe)."""
        self.sync_step_metrics()
        return self.metric_board.callback

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        return self.metric_board.progress_bar

    @property
    def logged_metrics(self) -> dict[str, float]:
        return self.metric_board.logged

    def sync_step_metrics(self) -> None:
        """Publish the step values logged since the last sync (one all_gather per stage that has any)."""
        for results in self.results.values():
            if results.pending:
                self.metric_board.publish_step(results.sync_step(self.fabric), results)

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.fabric.print(*args, **kwargs)

    def results_for_logging(self) -> Results:
        if self.current_stage not in self.results:
            raise MisconfigurationError(
                "self.log() was called outside a training/validation/test loop (e.g. in setup, on_fit_start or "
                "predict_step). Log from the *_step methods or the epoch/batch hooks."
            )
        return self.results[self.current_stage]

    def take_resume_state(self) -> dict[str, Any] | None:
        resume, self._resume = self._resume, None
        return resume

    def set_resume_state(self, state: dict[str, Any]) -> None:
        self._resume = state

    # ------------------------------------------------------------------ snapshots (tuning phases)
    def capture_loop(self) -> Callable[[], None]:
        """The loops' own state now: counters, the running stage, published metrics and accumulators, the
        sampler position. Calling the result puts it back (``core.module_state.TrainerSnapshot``)."""
        loop, stage = self.loop_state.snapshot(), self.current_stage
        board, results = self.metric_board.snapshot(), self.results
        sampler = self.train_sampler
        position = (sampler.epoch, sampler.skip) if sampler is not None else None

        def restore() -> None:
            self.loop_state.restore(loop)
            self.current_stage = stage
            self.metric_board.restore(board)
            self.results = results
            if position is not None:
                self.train_sampler.epoch, self.train_sampler.skip = position

        return restore

    # ------------------------------------------------------------------ the Module's step machinery
    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``Module.manual_backward``: the backward hooks around ``fabric.backward`` through the set-up model."""
        stepping.run_backward(self, loss, *args, **kwargs)

    def toggle_optimizer(self, module: Toggleable, optimizer: Any) -> None:
        """``Module.toggle_optimizer``: only ``optimizer``'s parameters require grad until untoggled."""
        stepping.toggle(self, module, optimizer)

    def untoggle_optimizer(self, module: Toggleable) -> None:
        """``Module.untoggle_optimizer``."""
        untoggle_params(module)

    def clip_gradients(self, optimizer: Any, value: float | None, algorithm: str | None) -> None:
        """``Module.clip_gradients`` under the Trainer's clipping settings (see ``stepping.clip``)."""
        stepping.clip(self, optimizer, value, algorithm)

    # ------------------------------------------------------------------ running a stage
    def _attach(self, model: Module | None, datamodule: DataModule | None, stage: str) -> Module:
        if model is None:
            if self._module is None:
                raise MisconfigurationError(f"trainer.{stage}() needs a model: pass one (no earlier fit set one).")
            model = self._module
        if not isinstance(model, Module):
            raise MisconfigurationError(
                f"The Trainer runs phalanx.Module subclasses (LightningModule); got {type(model).__name__}. Subclass "
                "phalanx.LightningModule (or write the loop yourself with phalanx.Fabric)."
            )
        if self._module is not None and model is not self._module and self.model is not None:
            self._release_model()
        self._module = model
        self.step_plan = None  # (a failed epoch of an earlier run may have left one behind)
        model._trainer = self
        if datamodule is not None:
            if not isinstance(datamodule, DataModule) and not hasattr(datamodule, "train_dataloader"):
                raise MisconfigurationError(
                    f"datamodule must be a phalanx.DataModule, got {type(datamodule).__name__}."
                )
            self.datamodule = datamodule
            datamodule.trainer = self
        owners: list[Any] = [self.datamodule] if self.datamodule is not None else []
        owners.append(model)
        for owner in owners:
            if overrides(owner, "prepare_data"):
                per_node = getattr(owner, "prepare_data_per_node", True)
                with self.fabric.rank_zero_first(local=per_node):
                    if (self.local_rank if per_node else self.global_rank) == 0:
                        owner.prepare_data()
        if self.datamodule is not None:
            self.datamodule.setup(stage)
        return model

    def _release_model(self) -> None:
        """Another model after an earlier stage (Lightning's ``trainer.test(other_model)`` after ``fit``): the
        strategy frees what it built for the old one (DDP's reducer, DeepSpeed's engine), and the new model is
        set up in the same processes on the same process group. Optimizers and schedulers belonged to the old
        model and go with it; the old module keeps its trained weights and can still be used on its own."""
        self.fabric.release(self.model)
        if self._module is not None:
            self._module._trainer = None
        self.model = None
        self.optimizers, self.step_optimizers, self.lr_scheduler_configs = [], [], []
        self.step_plan = None

    def _launch(self) -> None:
        """Start or join the processes (see the module docstring), then put per-process state on the
        device this rank got."""
        if not self.fabric._launched:
            self.fabric.launch()
            self.results = {s: Results(s, self.fabric.device) for s in STAGES}

    def _run(self, stage: str, model: Module | None, datamodule: DataModule | None, fn: Any, *args: Any) -> Any:
        if self.stage is not None:
            raise MisconfigurationError(f"trainer.{stage}() was called while trainer.{self.stage}() is running.")
        self._launch()
        module = self._attach(model, datamodule, stage)
        self._refuse_batch_transfer_hooks(module)
        self.stage = stage
        self.interrupted = False
        self._add_module_callbacks(module)
        self.accumulation = self._accumulation_schedule()
        self.profiler.setup(stage, self.global_rank, None)
        try:
            with deterministic(self.settings.deterministic, self.settings.benchmark):
                self.call("setup", stage)
                module.setup(stage)
                if overrides(module, "configure_model"):
                    with self.fabric.init_module():
                        module.configure_model()
                return fn(*args)
        except BaseException as exc:
            self.interrupted = True
            self.call("on_exception", exc)
            if self.datamodule is not None:
                self.datamodule.on_exception(exc)
            raise
        finally:
            self.call("teardown", stage)
            module.teardown(stage)
            if self.datamodule is not None:
                self.datamodule.teardown(stage)
            if self.is_global_zero:
                status = "failed" if self.interrupted else "success"
                for lg in self.loggers:  # as in Lightning, each stage ends its loggers' runs
                    if callable(getattr(lg, "finalize", None)):
                        lg.finalize(status)
                    elif callable(getattr(lg, "save", None)):
                        lg.save()
            self.profiler.describe()
            self.profiler.teardown(stage)
            self.stage = None
            self.current_stage = None

    def _refuse_batch_transfer_hooks(self, module: Module) -> None:
        """Lightning's batch-transfer hooks are refused rather than silently skipped: phalanx moves
        batches to the device inside its data loaders."""
        for owner in (module, self.datamodule):
            if owner is None:
                continue
            found = [h for h in ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
                     if overrides(owner, h)]
            if found:
                raise MisconfigurationError(
                    f"{type(owner).__name__} overrides {found}, which phalanx does not call: its data loaders move "
                    "each batch to the device themselves. Do that work in the DataLoader's collate_fn (before "
                    "the move) or at the start of the *_step methods (after it), and remove the overrides."
                )

    def _add_module_callbacks(self, module: Module) -> None:
        """``configure_callbacks()``: the module's callbacks replace the Trainer's of the same type."""
        extra = module.configure_callbacks()
        extra = list(extra) if isinstance(extra, (list, tuple)) else ([] if extra is None else [extra])
        if not extra:
            return
        types = {type(c) for c in extra}
        kept = [c for c in self.callbacks if type(c) not in types]
        self.callbacks = ordered(kept + extra)

    def _wrap(self, optimizers: list[Any] | None = None) -> None:
        """Set up the module once; set up (new) optimizers on every call that passes some."""
        if self.model is None:
            module = self.module
            if self.sync_batchnorm:
                module = self._with_sync_batchnorm(module)
            if not optimizers:
                self.model = self.fabric.setup_module(module)
            else:
                self.model, *opts = self.fabric.setup(module, *optimizers)
                self._set_optimizers(opts)
                return
        if optimizers:
            out = self.fabric.setup_optimizers(*optimizers)
            self._set_optimizers(list(out) if isinstance(out, tuple) else [out])

    def _with_sync_batchnorm(self, module: Module) -> Module:
        if self.world_size > 1 and self.fabric.device.type == "cpu":
            raise MisconfigurationError(
                "sync_batchnorm=True needs GPUs: torch's SyncBatchNorm does not run on CPU processes. Remove it, or "
                "train on CUDA devices."
            )
        torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)  # converts children in place; the root is a Module
        return module

    def _set_optimizers(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers
        self.step_optimizers = [StepOptimizer(opt, self) for opt in optimizers]

    def setup_optimizers(self) -> None:
        """Call ``configure_optimizers`` again and set up what it returns (e.g. after the LR finder
        changed ``model.lr``)."""
        module = self.lightning_module
        optimizers, configs = parse_all_optimizers(module.configure_optimizers())
        if module.automatic_optimization and len(optimizers) != 1:
            raise MisconfigurationError(
                f"configure_optimizers returned {len(optimizers)} optimizers; automatic optimization steps exactly "
                "one. Put all parameters in one optimizer (param groups for different settings), or set "
                "self.automatic_optimization = False and step them yourself in training_step."
            )
        self._wrap(optimizers)
        self.lr_scheduler_configs = configs

    def _check_manual_optimization(self) -> None:
        if self.module.automatic_optimization:
            return
        strategy = self.fabric.strategy
        if not strategy.supports_calls_outside_forward:
            raise MisconfigurationError(
                f"Manual optimization (automatic_optimization = False) is not supported with strategy="
                f"{strategy.name!r}: training_step runs outside the strategy's forward so that every "
                "manual_backward is synchronized, and this strategy gathers its parameters in that forward. Use "
                "automatic optimization, strategy='ddp', or a Fabric loop."
            )
        if self.settings.accumulate_grad_batches != 1:
            raise MisconfigurationError(
                "accumulate_grad_batches is for automatic optimization; with automatic_optimization = False, "
                "accumulate in training_step (step the optimizer every N batches) and remove the argument."
            )
        if self.gradient_clip_val is not None:
            raise MisconfigurationError(
                "gradient_clip_val is for automatic optimization; with automatic_optimization = False call "
                "self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm=...) before "
                "optimizer.step() and remove the Trainer argument."
            )

    def _data_from(self, given: Any, getter: str) -> Any:
        """Loaders: those given, else the datamodule's, else the module's own ``getter()``."""
        if given is not None:
            return given
        if self.datamodule is not None and overrides(self.datamodule, getter):
            return getattr(self.datamodule, getter)()
        if self._module is not None and overrides(self._module, getter):
            return getattr(self._module, getter)()
        if self.datamodule is not None and getter == "train_dataloader":
            return self.datamodule.train_dataloader()  # raises what is missing
        return None

    def _eval_loaders(self, dataloaders: Any, getter: str) -> list[Any]:
        loaders = as_list(self._data_from(dataloaders, getter))
        return [prepare_eval_loader(loader, self.fabric, self.use_distributed_sampler) for loader in loaders]

    def prepare_fit(self, train_dataloaders: Any = None, val_dataloaders: Any = None) -> None:
        """Loaders, model and optimizer for fitting (also used by the Tuner before a fit)."""
        self._train_source, self._val_source = train_dataloaders, val_dataloaders
        self._prepare_train_data()
        self.results = {s: Results(s, self.fabric.device) for s in STAGES}
        self.setup_optimizers()

    def _prepare_train_data(self) -> None:
        train = self._data_from(self._train_source, "train_dataloader")
        if train is None:
            raise MisconfigurationError(
                "trainer.fit() needs training data: pass train_dataloaders= or datamodule=, or implement the "
                "module's train_dataloader()."
            )
        if self.overfit_batches:
            train = sequential(train)
        uds = self.use_distributed_sampler
        self.train_dataloader, self.train_sampler = prepare_train_loader(train, self.fabric, uds)
        no_val = self.limit_val_batches == 0
        self.val_dataloaders = [] if no_val else self._eval_loaders(self._val_source, "val_dataloader")
        self.num_training_batches = num_batches(self.train_dataloader, self.limit_train_batches)
        self.val_check_batches = self._val_check_batches()

    def reload_dataloaders_if_due(self) -> None:
        """``reload_dataloaders_every_n_epochs``: at the start of every n-th epoch, call the loader
        methods again (the first epoch uses the loaders prepared for fit)."""
        n = self.reload_dataloaders_every_n_epochs
        if n and self.current_epoch > 0 and self.current_epoch % n == 0 and self.batches_done == 0:
            self._prepare_train_data()

    def _val_check_batches(self) -> int | None:
        interval = self.val_check_interval
        if isinstance(interval, float):
            if interval >= 1.0:
                return None
            if self.num_training_batches is None:
                raise MisconfigurationError(
                    "val_check_interval as a fraction needs training data with a length; pass an int (batches)."
                )
            return max(1, int(self.num_training_batches * interval))
        return interval if interval > 0 else None

