"""``phalanx.Trainer``: the managed loop, built only on ``phalanx.Fabric``'s public API.

Everything backend-specific (DDP, FSDP, DeepSpeed, precision) is Fabric's business; this file
never asks which strategy it runs on. ``Trainer(devices=2)`` launches the processes itself: under
plain ``python train.py`` the script re-runs in 2 processes right at the Trainer's construction.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from phalanx.errors import MisconfigurationError
from phalanx.fabric import Fabric
from phalanx.trainer import checkpointing, loops
from phalanx.trainer.data import as_list, num_batches, prepare_eval_loader, prepare_train_loader
from phalanx.trainer.module import DataModule, Module
from phalanx.trainer.optim import SchedulerConfig, parse_optimizers
from phalanx.trainer.results import MetricBoard, Results, reads_metrics

_STAGES = ("train", "validate", "test")


def _check_limit(name: str, value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise MisconfigurationError(
            f"{name} must be an int >= 0 (batches) or a float in [0, 1] (fraction), got {value!r}."
        )
    if isinstance(value, float) and value > 1.0:
        raise MisconfigurationError(f"{name}={value} is a float above 1.0; pass an int for a number of batches.")
    return value


class Trainer:
    """Runs a :class:`phalanx.Module`'s steps on any strategy, with logging, checkpoints and callbacks.

    Args:
        accelerator, devices, num_nodes, strategy, precision: passed to :class:`phalanx.Fabric`.
        max_epochs: epochs to train (default 1000, or unlimited when ``max_steps`` is set).
        max_steps: optimizer steps to train (-1: no limit).
        accumulate_grad_batches: micro-batches per optimizer step.
        gradient_clip_val / gradient_clip_algorithm: clip by total norm ("norm") or by value ("value").
        val_check_interval: validate every this many training batches (int) or fraction of an epoch (float).
        check_val_every_n_epoch: validate at the end of every n-th epoch (None: only val_check_interval).
        limit_{train,val,test,predict}_batches: int (batches) or float (fraction of the loader).
        callbacks: objects whose hook methods (``on_train_epoch_end(trainer, module)``, ...) are called.
        logger: True (a CSVLogger under default_root_dir), False, a logger or a list of loggers.
        enable_progress_bar, enable_checkpointing: add a ProgressBar / ModelCheckpoint unless one is given.
        deterministic: ``torch.use_deterministic_algorithms(True)``.
        default_root_dir: where logs and checkpoints go (default: the working directory).
        log_every_n_steps: how often step-level metrics go to the loggers.
        use_distributed_sampler: let phalanx shard the data across ranks (see phalanx.trainer.data).
        detect_anomaly: check every backward's loss and gradients for nan/inf and stop naming the parameter
            (``Fabric(detect_anomaly=True)``, see :mod:`phalanx.anomaly` for the cost). Without it, a
            non-finite training loss still stops the run before the optimizer step (see
            :mod:`phalanx.trainer.loops`).
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        devices: int | str = "auto",
        num_nodes: int = 1,
        strategy: Any = "auto",
        precision: str | int = "32-true",
        max_epochs: int | None = None,
        max_steps: int = -1,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        val_check_interval: int | float = 1.0,
        check_val_every_n_epoch: int | None = 1,
        limit_train_batches: int | float = 1.0,
        limit_val_batches: int | float = 1.0,
        limit_test_batches: int | float = 1.0,
        limit_predict_batches: int | float = 1.0,
        callbacks: Any = None,
        logger: Any = True,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        deterministic: bool = False,
        default_root_dir: str | Path | None = None,
        log_every_n_steps: int = 50,
        use_distributed_sampler: bool = True,
        detect_anomaly: bool = False,
    ) -> None:
        if accumulate_grad_batches < 1:
            raise MisconfigurationError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}.")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise MisconfigurationError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}; use 'norm' or 'value'.")
        if log_every_n_steps < 1:
            raise MisconfigurationError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}.")
        if max_epochs is not None and max_epochs < 0:
            raise MisconfigurationError(f"max_epochs must be >= 0, got {max_epochs}.")
        self.default_root_dir = Path(default_root_dir) if default_root_dir is not None else Path.cwd()
        self.fabric = Fabric(
            accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, precision=precision,
            loggers=self._make_loggers(logger), detect_anomaly=detect_anomaly,
        )
        self.fabric.launch()
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        self.max_steps = max_steps
        self.max_epochs = max_epochs if max_epochs is not None else (1000 if max_steps < 0 else sys.maxsize)
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val, self.gradient_clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        self.val_check_interval = _check_limit("val_check_interval", val_check_interval)
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.limit_train_batches = _check_limit("limit_train_batches", limit_train_batches)
        self.limit_val_batches = _check_limit("limit_val_batches", limit_val_batches)
        self.limit_test_batches = _check_limit("limit_test_batches", limit_test_batches)
        self.limit_predict_batches = _check_limit("limit_predict_batches", limit_predict_batches)
        self.log_every_n_steps = log_every_n_steps
        self.use_distributed_sampler = use_distributed_sampler
        self.callbacks: list[Any] = self._make_callbacks(callbacks, enable_progress_bar, enable_checkpointing)

        # Loop state (saved in checkpoints).
        self.global_step = 0
        self.current_epoch = 0
        self.batches_done = 0
        self.should_stop = False
        self.epoch_finished = False
        self.in_window = False
        self.epoch_start_rng: dict[str, Any] | None = None
        self._resume: dict[str, Any] | None = None
        self.ckpt_path: str | None = None

        # What the current run works on.
        self.stage: str | None = None  # "fit", "validate", "test", "predict" (or "lr_find")
        self.current_stage: str | None = None  # the loop running now: "train", "validate", "test"
        self._module: Module | None = None
        self.model: Any = None  # the set-up (wrapped) module
        self.optimizer: Any = None
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.datamodule: DataModule | None = None
        self.train_dataloader: Any = None
        self.train_sampler: Any = None
        self.val_dataloaders: list[Any] = []
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

    def _make_callbacks(self, callbacks: Any, progress: bool, checkpointing_on: bool) -> list[Any]:
        from phalanx.callbacks import ModelCheckpoint, ProgressBar

        given = list(callbacks) if isinstance(callbacks, (list, tuple)) else ([] if callbacks is None else [callbacks])
        if progress and not any(isinstance(c, ProgressBar) for c in given):
            given.insert(0, ProgressBar())  # first: it closes its bar before other callbacks print
        if checkpointing_on and not any(isinstance(c, ModelCheckpoint) for c in given):
            given.append(ModelCheckpoint())
        # Checkpoint callbacks last, so what they save includes every other callback's update of this hook.
        checkpoints = [c for c in given if isinstance(c, ModelCheckpoint)]
        return [c for c in given if not isinstance(c, ModelCheckpoint)] + checkpoints

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

    # ------------------------------------------------------------------ hooks and metrics (used by loops)
    def call(self, hook: str, *args: Any) -> None:
        """Call ``hook(trainer, module, *args)`` on every callback that defines it."""
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if callable(method):
                if reads_metrics(method):  # user code may read callback_metrics on one rank only
                    self.sync_step_metrics()
                method(self, self.module, *args)

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
                f"The Trainer runs phalanx.Module subclasses; got {type(model).__name__}. Subclass phalanx.Module "
                "(or write the loop yourself with phalanx.Fabric)."
            )
        if self._module is not None and model is not self._module and self.model is not None:
            raise MisconfigurationError(
                "This Trainer already set up another model. Use one Trainer per model (the process group it "
                "created can be shared by only one), or pass the same model again."
            )
        self._module = model
        model._trainer = self
        if datamodule is not None:
            if not isinstance(datamodule, DataModule) and not hasattr(datamodule, "train_dataloader"):
                raise MisconfigurationError(
                    f"datamodule must be a phalanx.DataModule, got {type(datamodule).__name__}."
                )
            self.datamodule = datamodule
            datamodule.trainer = self
            with self.fabric.rank_zero_first(local=True):
                if self.local_rank == 0:
                    datamodule.prepare_data()
            datamodule.setup(stage)
        return model

    def _run(self, stage: str, model: Module | None, datamodule: DataModule | None, fn: Any, *args: Any) -> Any:
        if self.stage is not None:
            raise MisconfigurationError(f"trainer.{stage}() was called while trainer.{self.stage}() is running.")
        module = self._attach(model, datamodule, stage)
        self.stage = stage
        try:
            module.setup(stage)
            self.call("setup", stage)
            return fn(*args)
        except BaseException as exc:
            self.call("on_exception", exc)
            raise
        finally:
            module.teardown(stage)
            self.call("teardown", stage)
            if self.datamodule is not None:
                self.datamodule.teardown(stage)
            if self.is_global_zero:
                for lg in self.loggers:
                    if callable(getattr(lg, "save", None)):
                        lg.save()
            self.stage = None
            self.current_stage = None

    def _wrap(self, optimizer: Any = None) -> None:
        """Set up the module once; set up (new) optimizers on every call that passes one."""
        if self.model is None:
            if optimizer is None:
                self.model = self.fabric.setup_module(self.module)
            else:
                self.model, self.optimizer = self.fabric.setup(self.module, optimizer)
                return
        if optimizer is not None:
            self.optimizer = self.fabric.setup_optimizers(optimizer)

    def setup_optimizers(self) -> None:
        """Call ``configure_optimizers`` again and set up what it returns (e.g. after the LR finder
        changed ``model.lr``)."""
        optimizer, configs = parse_optimizers(self.lightning_module.configure_optimizers())
        self._wrap(optimizer)
        self.lr_scheduler_configs = configs

    def _eval_loaders(self, dataloaders: Any, getter: str) -> list[Any]:
        loaders = as_list(dataloaders)
        if not loaders and self.datamodule is not None:
            loaders = as_list(getattr(self.datamodule, getter)())
        return [prepare_eval_loader(loader, self.fabric, self.use_distributed_sampler) for loader in loaders]

    def prepare_fit(self, train_dataloaders: Any = None, val_dataloaders: Any = None) -> None:
        """Loaders, model and optimizer for fitting (also used by the Tuner before a fit)."""
        train = train_dataloaders
        if train is None and self.datamodule is not None:
            train = self.datamodule.train_dataloader()
        if train is None:
            raise MisconfigurationError("trainer.fit() needs training data: pass train_dataloaders= or datamodule=.")
        uds = self.use_distributed_sampler
        self.train_dataloader, self.train_sampler = prepare_train_loader(train, self.fabric, uds)
        no_val = self.limit_val_batches == 0
        self.val_dataloaders = [] if no_val else self._eval_loaders(val_dataloaders, "val_dataloader")
        self.num_training_batches = num_batches(self.train_dataloader, self.limit_train_batches)
        self.val_check_batches = self._val_check_batches()
        self.results = {s: Results(s, self.fabric.device) for s in _STAGES}
        self.setup_optimizers()

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
        if ckpt_path is None:
            return None
        if ckpt_path in ("last", "best"):
            attr = "last_model_path" if ckpt_path == "last" else "best_model_path"
            found = [getattr(cb, attr, "") for cb in self.checkpoint_callbacks]
            if ckpt_path == "last":
                found += [str(Path(cb.dirpath) / "last.ckpt") for cb in self.checkpoint_callbacks if cb.dirpath]
            existing = [p for p in found if p and Path(p).is_file()]
            if not existing:
                if ckpt_path == "best":
                    raise MisconfigurationError(
                        "ckpt_path='best' needs a ModelCheckpoint with a monitor that has saved a checkpoint."
                    )
                self.print("[phalanx] ckpt_path='last': no last.ckpt found in the ModelCheckpoint folders; starting "
                           "from scratch.", file=sys.stderr)
                return None
            return Path(existing[0])
        path = Path(ckpt_path)
        if not path.exists():
            raise MisconfigurationError(f"ckpt_path={str(ckpt_path)!r} does not exist.")
        return path

    # ------------------------------------------------------------------ public entry points
    def fit(
        self,
        model: Module,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | Path | None = None,
    ) -> None:
        """Train ``model``; with ``ckpt_path`` (a path, "last" or "best") resume exactly where it stopped."""
        self._run("fit", model, datamodule, self._fit, train_dataloaders, val_dataloaders, ckpt_path)

    def _fit(self, train_dataloaders: Any, val_dataloaders: Any, ckpt_path: Any) -> None:
        self.should_stop = False
        self.prepare_fit(train_dataloaders, val_dataloaders)
        path = self._resolve_ckpt_path(ckpt_path)
        self.ckpt_path = str(path) if path is not None else None
        if path is not None:
            checkpointing.restore(self, path)
        module = self.lightning_module
        if self.is_global_zero and module.hparams:
            for lg in self.loggers:
                if callable(getattr(lg, "log_hyperparams", None)):
                    lg.log_hyperparams(module.hparams)
        self.call("on_fit_start")
        module.on_fit_start()
        self.current_stage = "train"
        loops.run_fit(self)
        self.current_stage = None
        self.call("on_fit_end")
        module.on_fit_end()

    def validate(
        self, model: Module | None = None, dataloaders: Any = None, datamodule: DataModule | None = None,
        ckpt_path: str | Path | None = None, verbose: bool = True,
    ) -> list[dict[str, float]]:
        """Run ``validation_step`` over the data; returns one dict of epoch metrics per dataloader."""
        return self._run("validate", model, datamodule, self._evaluate, "validate", dataloaders, ckpt_path, verbose)  # type: ignore[no-any-return]

    def test(
        self, model: Module | None = None, dataloaders: Any = None, datamodule: DataModule | None = None,
        ckpt_path: str | Path | None = None, verbose: bool = True,
    ) -> list[dict[str, float]]:
        """Run ``test_step`` over the data; returns one dict of epoch metrics per dataloader."""
        return self._run("test", model, datamodule, self._evaluate, "test", dataloaders, ckpt_path, verbose)  # type: ignore[no-any-return]

    def _evaluate(self, stage: str, dataloaders: Any, ckpt_path: Any, verbose: bool) -> list[dict[str, float]]:
        loaders = self._eval_loaders(dataloaders, "val_dataloader" if stage == "validate" else "test_dataloader")
        if not loaders:
            raise MisconfigurationError(f"trainer.{stage}() needs data: pass dataloaders= or datamodule=.")
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
        ckpt_path: str | Path | None = None,
    ) -> list[Any]:
        """``predict_step`` outputs of THIS rank's share of the data (a list per dataloader when there
        are several). Gather them with ``trainer.fabric.all_gather`` if every rank needs all of them."""
        return self._run("predict", model, datamodule, self._predict, dataloaders, ckpt_path)  # type: ignore[no-any-return]

    def _predict(self, dataloaders: Any, ckpt_path: Any) -> list[Any]:
        loaders = self._eval_loaders(dataloaders, "predict_dataloader")
        if not loaders:
            raise MisconfigurationError("trainer.predict() needs data: pass dataloaders= or datamodule=.")
        self._wrap()
        path = self._resolve_ckpt_path(ckpt_path)
        if path is not None:
            checkpointing.load_weights(self, path)
        self.current_stage = "predict"
        out = loops.run_predict(self, loaders, self.limit_predict_batches)
        return out[0] if len(out) == 1 else out

    def save_checkpoint(self, path: str | Path, weights_only: bool = False) -> None:
        """Save everything needed to resume (call on every rank; rank 0 writes atomically)."""
        checkpointing.save(self, path, weights_only)
