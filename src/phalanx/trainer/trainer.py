"""``phalanx.Trainer``: the managed loop, built only on ``phalanx.Fabric``'s public API.

Everything backend-specific (DDP, FSDP, DeepSpeed, precision) is Fabric's business; this file
never asks which strategy it runs on.

When processes start (as in Lightning): constructing a Trainer starts nothing. Under torchrun or
``phalanx run`` the ranks are known from the environment right away (``trainer.global_rank``); the
process group is joined at the first ``fit``/``validate``/``test``/``predict``/tuner call. Under plain
``python train.py`` with ``devices=N``, that first call re-runs the script in N processes and the
original process only supervises them (it exits with the job's code when they finish).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from phalanx.core.module import DataModule, Module, no_op_hooks, overrides
from phalanx.fabric.fabric import Fabric
from phalanx.profilers import resolve_profiler
from phalanx.trainer import checkpointing, loops
from phalanx.trainer.data import as_list, num_batches, prepare_eval_loader, prepare_train_loader
from phalanx.trainer.hooks import TrainerHooks
from phalanx.trainer.optim import SchedulerConfig, parse_all_optimizers
from phalanx.trainer.results import MetricBoard, Results
from phalanx.trainer.settings import (
    check_weights_only,
    refuse_plugins,
    resolve,
    sequential,
    split_datamodule,
)
from phalanx.trainer.stepping import StepOptimizer, StepPlan
from phalanx.trainer.views import TrainerViews
from phalanx.utils import diagnostics
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.seed import capture_rng_state, restore_rng_state

_STAGES = ("train", "validate", "test")


@contextlib.contextmanager
def _deterministic(mode: bool | str | None, benchmark: bool | None) -> Iterator[None]:
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


class Trainer(TrainerViews, TrainerHooks):
    """Runs a :class:`phalanx.Module`'s steps on any strategy, with logging, checkpoints and callbacks.

    The arguments are Lightning's, with its defaults and meaning (docs/trainer.md; deliberate
    differences are listed in docs/porting.md). Every one is implemented or refused with a reason.

    Args:
        accelerator, strategy, devices, num_nodes, precision: passed to :class:`phalanx.Fabric`.
        logger: None/True (a CSVLogger under default_root_dir), False, a logger or a list of loggers.
        callbacks: objects whose hook methods (``on_train_epoch_end(trainer, module)``, ...) are called.
        fast_dev_run: run N (True: 1) batches of each loop once, without loggers or checkpoints.
        max_epochs / min_epochs / max_steps / min_steps / max_time: when training stops; a stop request
            (early stopping) is deferred until the minimums are met.
        limit_{train,val,test,predict}_batches / overfit_batches: int (batches) or float (fraction).
        val_check_interval: validate every this many training batches (int) or fraction of an epoch (float).
        check_val_every_n_epoch: validate at the end of every n-th epoch (None: only val_check_interval).
        num_sanity_val_steps: validation batches run before training to catch bugs early (-1: all).
            Their metrics are discarded and every RNG is put back, so the fit is the same with or without.
        deterministic: ``torch.use_deterministic_algorithms(True)`` (``"warn"``: warn only) and
            ``cudnn.benchmark = False`` while fit/validate/test/predict (or the tuner) runs; the previous
            settings are restored when it returns, so code after it, or another Trainer, is unaffected.
        log_every_n_steps: how often step-level metrics go to the loggers.
        enable_checkpointing / enable_progress_bar / enable_model_summary: add the default callbacks.
        accumulate_grad_batches, gradient_clip_val, gradient_clip_algorithm ("norm" or "value").
        benchmark: ``torch.backends.cudnn.benchmark`` (None: leave it, False when deterministic).
        inference_mode: evaluate under ``torch.inference_mode`` (else ``torch.no_grad``).
        use_distributed_sampler: let phalanx shard the data across ranks (see phalanx.trainer.data).
        profiler: "simple", "advanced", "pytorch" or a :class:`phalanx.profilers.Profiler`.
        barebones: turn off everything that costs time outside the steps (refuses arguments that need it).
        plugins: refused (see :func:`phalanx.trainer.settings.refuse_plugins` for each equivalent).
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm before setup.
        reload_dataloaders_every_n_epochs: call the ``*_dataloader()`` methods again every n epochs.
        default_root_dir: where logs and checkpoints go (default: the working directory).
        enable_autolog_hparams: send ``module.hparams`` to the loggers when fit starts.
        model_registry: refused (phalanx uploads nothing).
        detect_anomaly: check every backward's loss and gradients for nan/inf and stop naming the parameter
            (``Fabric(detect_anomaly=True)``, see :mod:`phalanx.fabric.anomaly` for the cost). Without it, a
            non-finite training loss still stops the run before the optimizer step (see
            :mod:`phalanx.trainer.loops`).
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: Any = "auto",
        devices: int | str = "auto",
        num_nodes: int = 1,
        precision: str | int | None = None,
        logger: Any = None,
        callbacks: Any = None,
        fast_dev_run: int | bool = False,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: Any = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        overfit_batches: int | float = 0.0,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int | None = None,
        log_every_n_steps: int | None = None,
        enable_checkpointing: bool | None = None,
        enable_progress_bar: bool | None = None,
        enable_model_summary: bool | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
        deterministic: bool | str | None = None,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        use_distributed_sampler: bool = True,
        profiler: Any = None,
        detect_anomaly: bool = False,
        barebones: bool = False,
        plugins: Any = None,
        sync_batchnorm: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        default_root_dir: str | Path | None = None,
        enable_autolog_hparams: bool = True,
        model_registry: str | None = None,
    ) -> None:
        settings = resolve(dict(locals()))
        refuse_plugins(plugins)
        if model_registry is not None:
            raise MisconfigurationError(
                f"model_registry={model_registry!r} is not supported: phalanx uploads nothing. Remove it and copy the "
                "checkpoint (ModelCheckpoint.best_model_path) to your registry yourself."
            )
        if accumulate_grad_batches < 1:
            raise MisconfigurationError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}.")
        if reload_dataloaders_every_n_epochs < 0:
            raise MisconfigurationError(
                f"reload_dataloaders_every_n_epochs must be >= 0, got {reload_dataloaders_every_n_epochs}."
            )
        if deterministic not in (None, True, False, "warn"):
            raise MisconfigurationError(f"deterministic={deterministic!r}; use True, False or 'warn'.")
        self.default_root_dir = Path(default_root_dir) if default_root_dir is not None else Path.cwd()
        self.fabric = Fabric(
            accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
            precision=precision if precision is not None else "32-true",
            loggers=self._make_loggers(settings.logger), detect_anomaly=detect_anomaly,
        )
        if benchmark and deterministic:
            raise MisconfigurationError("benchmark=True picks kernels by speed, which deterministic=True forbids.")
        self.deterministic, self.benchmark = deterministic, benchmark  # applied per run: see _deterministic
        self.fast_dev_run = settings.fast_dev_run
        if self.fast_dev_run:
            diagnostics.info(f"Running in fast_dev_run mode: each loop runs {self.fast_dev_run} batch(es); logging "
                             "and checkpointing are off.", rank=self.fabric.global_rank)
        self.max_steps, self.min_steps, self.min_epochs = settings.max_steps, settings.min_steps, settings.min_epochs
        max_epochs = settings.max_epochs
        if max_epochs is None or max_epochs == -1:
            max_epochs = (1000 if settings.max_steps < 0 else sys.maxsize) if max_epochs is None else sys.maxsize
        self.max_epochs = max_epochs
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = settings.gradient_clip_algorithm
        self.gradient_clip_algorithm_given = gradient_clip_algorithm is not None
        self.val_check_interval = settings.val_check_interval
        self.check_val_every_n_epoch = settings.check_val_every_n_epoch
        self.limit_train_batches = settings.limit_train_batches
        self.limit_val_batches = settings.limit_val_batches
        self.limit_test_batches = settings.limit_test_batches
        self.limit_predict_batches = settings.limit_predict_batches
        self.overfit_batches = settings.overfit_batches
        self.num_sanity_val_steps = settings.num_sanity_val_steps
        self.log_every_n_steps = settings.log_every_n_steps
        self.use_distributed_sampler = use_distributed_sampler
        self.inference_mode = inference_mode
        self.sync_batchnorm = sync_batchnorm
        self.reload_dataloaders_every_n_epochs = reload_dataloaders_every_n_epochs
        self.enable_autolog_hparams = enable_autolog_hparams
        self.barebones = barebones
        self.profiler = resolve_profiler(profiler)
        self.callbacks: list[Any] = self._make_callbacks(
            callbacks, settings.enable_progress_bar, settings.enable_checkpointing, settings.enable_model_summary,
            max_time,
        )

        # Loop state (saved in checkpoints).
        self.global_step = 0
        self.current_epoch = 0
        self.batches_done = 0
        self._should_stop = False
        self.epoch_finished = False
        self.in_window = False
        self._hook_methods: dict[str, tuple[tuple[Any, ...], list[tuple[Any, Any]]]] = {}
        self.signature_cache: dict[Any, bool] = {}  # see stepping._legacy_optimizer_step
        self._no_op_hooks = no_op_hooks()
        self.window_losses: list[tuple[int, torch.Tensor]] = []  # the window's losses, checked before its step
        self.step_plan: StepPlan | None = None  # what a training batch calls, decided per epoch (loops.py)
        self.epoch_start_rng: dict[str, Any] | None = None
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
        self.results: dict[str, Results] = {s: Results(s, self.fabric.device) for s in _STAGES}
        self.metric_board = MetricBoard()

    # ------------------------------------------------------------------ construction helpers
    def _make_loggers(self, logger: Any) -> list[Any]:
        if logger is True:
            from phalanx.loggers import CSVLogger

            return [CSVLogger(root_dir=self.default_root_dir, name="phalanx_logs")]
        if logger is False or logger is None:
            return []
        loggers = list(logger) if isinstance(logger, (list, tuple)) else [logger]
        for lg in loggers:
            if not callable(getattr(lg, "log_metrics", None)):
                raise MisconfigurationError(f"logger {lg!r} has no log_metrics(metrics, step) method.")
        return loggers

    def _make_callbacks(
        self, callbacks: Any, progress: bool, checkpointing_on: bool, summary: bool, max_time: Any
    ) -> list[Any]:
        from phalanx.callbacks import ModelCheckpoint, ProgressBar
        from phalanx.callbacks.model_summary import ModelSummary
        from phalanx.callbacks.timer import Timer

        given = list(callbacks) if isinstance(callbacks, (list, tuple)) else ([] if callbacks is None else [callbacks])
        if progress and not any(isinstance(c, ProgressBar) for c in given):
            given.insert(0, ProgressBar())  # first: it closes its bar before other callbacks print
        if summary and not any(isinstance(c, ModelSummary) for c in given):
            given.append(ModelSummary())
        if max_time is not None:
            if any(isinstance(c, Timer) for c in given):
                raise MisconfigurationError("Pass max_time= or a Timer callback, not both.")
            given.append(Timer(duration=max_time))
        if checkpointing_on and not any(isinstance(c, ModelCheckpoint) for c in given):
            given.append(ModelCheckpoint())
        return self._ordered(given)

    @staticmethod
    def _ordered(callbacks: list[Any]) -> list[Any]:
        from phalanx.callbacks import ModelCheckpoint

        # Checkpoint callbacks last, so what they save includes every other callback's update of this hook.
        checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
        return [c for c in callbacks if not isinstance(c, ModelCheckpoint)] + checkpoints

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
        return 0 <= self.max_steps <= self.global_step

    @property
    def train_samples_per_batch(self) -> int:
        """Global samples consumed per training batch (all ranks), for resuming the sampler."""
        if self.train_sampler is None or self.train_dataloader is None:
            return 0
        return int(self.train_dataloader.batch_size or 1) * int(self.train_sampler.num_replicas)

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
            raise MisconfigurationError(
                "This Trainer already set up another model. Use one Trainer per model (the process group it "
                "created can be shared by only one), or pass the same model again."
            )
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

    def _launch(self) -> None:
        """Start or join the processes (see the module docstring), then put per-process state on the
        device this rank got."""
        if not self.fabric._launched:
            self.fabric.launch()
            self.results = {s: Results(s, self.fabric.device) for s in _STAGES}

    def _run(self, stage: str, model: Module | None, datamodule: DataModule | None, fn: Any, *args: Any) -> Any:
        if self.stage is not None:
            raise MisconfigurationError(f"trainer.{stage}() was called while trainer.{self.stage}() is running.")
        self._launch()
        module = self._attach(model, datamodule, stage)
        self._refuse_batch_transfer_hooks(module)
        self.stage = stage
        self.interrupted = False
        self._add_module_callbacks(module)
        self.profiler.setup(stage, self.global_rank, None)
        try:
            with _deterministic(self.deterministic, self.benchmark):
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
        self.callbacks = self._ordered(kept + extra)

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
        if self.accumulate_grad_batches != 1:
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
        self.results = {s: Results(s, self.fabric.device) for s in _STAGES}
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

    def _resolve_ckpt_path(self, ckpt_path: str | Path | None) -> Path | None:
        return checkpointing.resolve(self, ckpt_path)

    # ------------------------------------------------------------------ public entry points
    def fit(
        self,
        model: Module,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | Path | None = None,
        weights_only: bool | None = None,
    ) -> None:
        """Train ``model``; with ``ckpt_path`` (a path, "last" or "best") resume exactly where it stopped.

        Data: ``train_dataloaders``/``val_dataloaders``, or a ``datamodule`` (also accepted in the
        place of ``train_dataloaders``), or the module's own ``train_dataloader()``/``val_dataloader()``."""
        check_weights_only(weights_only)
        if isinstance(train_dataloaders, DataModule):
            if datamodule is not None:
                raise MisconfigurationError("trainer.fit() got two datamodules (train_dataloaders= and datamodule=).")
            datamodule, train_dataloaders = train_dataloaders, None
        if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
            raise MisconfigurationError(
                "trainer.fit() got both dataloaders and a datamodule; pass one source of data."
            )
        self._run("fit", model, datamodule, self._fit, train_dataloaders, val_dataloaders, ckpt_path)

    def _fit(self, train_dataloaders: Any, val_dataloaders: Any, ckpt_path: Any) -> None:
        self._should_stop = False
        self._check_manual_optimization()
        self.prepare_fit(train_dataloaders, val_dataloaders)
        path = self._resolve_ckpt_path(ckpt_path)
        self.ckpt_path = str(path) if path is not None else None
        if path is not None:
            checkpointing.restore(self, path)
        module = self.lightning_module
        if self.enable_autolog_hparams and self.is_global_zero and getattr(module, "_log_hyperparams", True):
            hparams = dict(module.hparams)
            if self.datamodule is not None and getattr(self.datamodule, "_log_hyperparams", True):
                hparams.update(self.datamodule.hparams)
            if hparams:
                for lg in self.loggers:
                    if callable(getattr(lg, "log_hyperparams", None)):
                        lg.log_hyperparams(hparams)
        self.call("on_fit_start")
        module.on_fit_start()
        self._sanity_check()
        self.current_stage = "train"
        self.hook("on_train_start")
        loops.run_fit(self)
        self.current_stage = "train"
        self.hook("on_train_end")
        self.current_stage = None
        self.call("on_fit_end")
        module.on_fit_end()
        for cb in self.checkpoint_callbacks:  # loggers that upload checkpoints at the end (log_model=True)
            self._after_save_checkpoint(cb)

    def _sanity_check(self) -> None:
        """Run a few validation batches before training, then put everything back: their metrics are
        dropped, nothing is logged, and every RNG state is restored, so the fit that follows is the
        same as without the check."""
        n = self.num_sanity_val_steps
        if not n or not self.val_dataloaders or self.limit_val_batches == 0:
            return
        rng = capture_rng_state()
        self.sync_step_metrics()
        saved = self.metric_board.snapshot()
        self.sanity_checking = True
        try:
            self.call("on_sanity_check_start")
            limited = max(self.num_val_batches)  # what limit_val_batches allows, per Lightning's min(...)
            limit = self.limit_val_batches if math.isinf(n) else int(min(n, limited))
            loops.run_evaluation(self, "validate", self.val_dataloaders, limit)
            self.call("on_sanity_check_end")
        finally:
            self.sanity_checking = False
        self.metric_board.restore(saved)
        self.results["validate"].reset()
        restore_rng_state(rng)

    def validate(
        self, model: Module | None = None, dataloaders: Any = None, ckpt_path: str | Path | None = None,
        verbose: bool = True, datamodule: DataModule | None = None, weights_only: bool | None = None,
    ) -> list[dict[str, float]]:
        """Run ``validation_step`` over the data; returns one dict of epoch metrics per dataloader."""
        check_weights_only(weights_only)
        dataloaders, datamodule = split_datamodule(dataloaders, datamodule)
        return self._run("validate", model, datamodule, self._evaluate, "validate", dataloaders, ckpt_path, verbose)  # type: ignore[no-any-return]

    def test(
        self, model: Module | None = None, dataloaders: Any = None, ckpt_path: str | Path | None = None,
        verbose: bool = True, datamodule: DataModule | None = None, weights_only: bool | None = None,
    ) -> list[dict[str, float]]:
        """Run ``test_step`` over the data; returns one dict of epoch metrics per dataloader."""
        check_weights_only(weights_only)
        dataloaders, datamodule = split_datamodule(dataloaders, datamodule)
        return self._run("test", model, datamodule, self._evaluate, "test", dataloaders, ckpt_path, verbose)  # type: ignore[no-any-return]

    def _evaluate(self, stage: str, dataloaders: Any, ckpt_path: Any, verbose: bool) -> list[dict[str, float]]:
        getter = "val_dataloader" if stage == "validate" else "test_dataloader"
        loaders = self._eval_loaders(dataloaders, getter)
        if not loaders:
            raise MisconfigurationError(
                f"trainer.{stage}() needs data: pass dataloaders= or datamodule=, or implement the module's {getter}()."
            )
        if stage == "test":
            self.test_dataloaders = loaders
        else:
            self.val_dataloaders = loaders
        self._wrap()
        path = self._resolve_ckpt_path(ckpt_path)
        if path is not None:
            checkpointing.load_weights(self, path)
        limit = self.limit_val_batches if stage == "validate" else self.limit_test_batches
        out = loops.run_evaluation(self, stage, loaders, limit)
        if verbose:
            for i, metrics in enumerate(out):
                shown = ", ".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items()))
                self.print(f"[{stage}{f' dataloader {i}' if len(out) > 1 else ''}] {shown}")
        return out

    def predict(
        self, model: Module | None = None, dataloaders: Any = None, datamodule: DataModule | None = None,
        return_predictions: bool | None = None, ckpt_path: str | Path | None = None, weights_only: bool | None = None,
    ) -> Any:
        """``predict_step`` outputs of THIS rank's share of the data (a list per dataloader when there
        are several; None with ``return_predictions=False``). Gather them with
        ``trainer.fabric.all_gather`` if every rank needs all of them."""
        check_weights_only(weights_only)
        dataloaders, datamodule = split_datamodule(dataloaders, datamodule)
        out = self._run("predict", model, datamodule, self._predict, dataloaders, ckpt_path)
        return None if return_predictions is False else out

    def _predict(self, dataloaders: Any, ckpt_path: Any) -> list[Any]:
        loaders = self._eval_loaders(dataloaders, "predict_dataloader")
        if not loaders:
            raise MisconfigurationError(
                "trainer.predict() needs data: pass dataloaders= or datamodule=, or implement the module's "
                "predict_dataloader()."
            )
        self.predict_dataloaders = loaders
        self._wrap()
        path = self._resolve_ckpt_path(ckpt_path)
        if path is not None:
            checkpointing.load_weights(self, path)
        self.current_stage = "predict"
        out = loops.run_predict(self, loaders, self.limit_predict_batches)
        return out[0] if len(out) == 1 else out

    def save_checkpoint(
        self, filepath: str | Path, weights_only: bool | None = None, storage_options: Any = None
    ) -> None:
        """Save everything needed to resume (call on every rank; rank 0 writes atomically)."""
        if storage_options is not None:
            raise MisconfigurationError(
                "save_checkpoint(storage_options=...) is not supported: checkpoints are written by the strategy "
                "(atomically, to a local or mounted path). Remove storage_options."
            )
        checkpointing.save(self, filepath, bool(weights_only))

