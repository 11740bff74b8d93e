"""Resolving ``Trainer(...)`` arguments into one consistent set of settings, with Lightning's meaning.

No Lightning argument is accepted and ignored: every one is either implemented (its effect is set
below or where the setting is read) or refused with a reason and what to do instead, since a port that
silently trains differently is worse than one that fails.

The result is a frozen :class:`Settings`: the Trainer holds it (``trainer.settings``) and its public
attributes of the same names (``trainer.max_epochs``, ...) read it, so a setting is resolved once and
cannot be changed behind the loops' back in the middle of a run.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import torch

from phalanx.utils import diagnostics
from phalanx.utils.duration import parse_duration
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.datamodule import DataModule
    from phalanx.core.module import Module

__all__ = [
    "ReadOnly",
    "Settings",
    "TrainerArguments",
    "check_limit",
    "check_weights_only",
    "checkpoint_marks",
    "deterministic",
    "off_in_fast_dev_run",
    "parse_duration",
    "refuse_plugins",
    "resolve_settings",
    "sequential",
    "split_datamodule",
]


@dataclass(frozen=True)
class Settings:
    """Every ``Trainer(...)`` argument after :func:`resolve`: defaults applied, interactions (barebones,
    fast_dev_run, overfit_batches) folded in, values checked."""

    max_epochs: int  # None and -1 resolved (see resolve)
    min_epochs: int | None
    max_steps: int
    min_steps: int | None
    limit_train_batches: int | float
    limit_val_batches: int | float
    limit_test_batches: int | float
    limit_predict_batches: int | float
    overfit_batches: int | float
    val_check_interval: int | float
    check_val_every_n_epoch: int | None
    num_sanity_val_steps: int | float
    log_every_n_steps: int
    fast_dev_run: int
    enable_checkpointing: bool
    enable_progress_bar: bool
    enable_model_summary: bool
    logger: Any  # True/False or the logger object(s) given
    accumulate_grad_batches: int  # a constant schedule (trainer.accumulation), unless a callback supplies one
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    gradient_clip_algorithm_given: bool  # given explicitly: clip_gradients(...) may then not contradict it
    deterministic: bool | str | None
    benchmark: bool | None
    inference_mode: bool
    use_distributed_sampler: bool
    sync_batchnorm: bool
    reload_dataloaders_every_n_epochs: int
    enable_autolog_hparams: bool
    barebones: bool
    default_root_dir: Path


@dataclass(frozen=True)
class TrainerArguments:
    """The ``Trainer(...)`` arguments :func:`resolve_settings` reads, as given (defaults are the Trainer's
    signature; the others go to its Fabric, callbacks and profiler)."""

    logger: Any
    fast_dev_run: int | bool
    max_epochs: int | None
    min_epochs: int | None
    max_steps: int
    min_steps: int | None
    limit_train_batches: int | float | None
    limit_val_batches: int | float | None
    limit_test_batches: int | float | None
    limit_predict_batches: int | float | None
    overfit_batches: int | float
    val_check_interval: Any  # an int or float; a time interval is refused with a reason
    check_val_every_n_epoch: int | None
    num_sanity_val_steps: int | None
    log_every_n_steps: int | None
    enable_checkpointing: bool | None
    enable_progress_bar: bool | None
    enable_model_summary: bool | None
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    gradient_clip_algorithm: str | None
    deterministic: bool | str | None
    benchmark: bool | None
    inference_mode: bool
    use_distributed_sampler: bool
    profiler: Any
    detect_anomaly: bool
    barebones: bool
    plugins: Any
    sync_batchnorm: bool
    reload_dataloaders_every_n_epochs: int
    default_root_dir: str | Path | None
    enable_autolog_hparams: bool
    model_registry: str | None


T = TypeVar("T")


class ReadOnly(Generic[T]):
    """A read-only Trainer attribute that reads the attribute of the same name of one of the Trainer's
    parts (``max_epochs = ReadOnly[int]("settings")`` on the class reads ``trainer.settings.max_epochs``):
    declared once, stored once."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> ReadOnly[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: object, value: T) -> None:
        raise AttributeError(f"trainer.{self.name} is read-only: it is trainer.{self.part}.{self.name}.")


def check_limit(name: str, value: Any) -> int | float:
    """An int >= 0 (batches) or a float in [0, 1] (fraction); None means all (1.0)."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise MisconfigurationError(
            f"{name} must be an int >= 0 (batches) or a float in [0, 1] (fraction), got {value!r}."
        )
    if isinstance(value, float) and value > 1.0:
        raise MisconfigurationError(f"{name}={value} is a float above 1.0; pass an int for a number of batches.")
    return value


def _refuse_unless_disabled(barebones: bool, name: str, value: Any, disabled: Any) -> None:
    if barebones and value is not None and value != disabled:
        raise MisconfigurationError(
            f"Trainer(barebones=True) turns off {name}; remove {name}={value!r} (or barebones=True)."
        )


def resolve_settings(args: TrainerArguments) -> Settings:
    """Lightning's defaults and interactions: barebones, fast_dev_run, overfit_batches, the limits."""
    barebones = bool(args.barebones)
    for name, value, disabled in (
        ("logger", args.logger, False), ("enable_checkpointing", args.enable_checkpointing, False),
        ("enable_progress_bar", args.enable_progress_bar, False),
        ("enable_model_summary", args.enable_model_summary, False),
        ("num_sanity_val_steps", args.num_sanity_val_steps, 0), ("profiler", args.profiler, None),
        ("detect_anomaly", args.detect_anomaly, False),
    ):
        _refuse_unless_disabled(barebones, name, value, disabled)
    if barebones and args.log_every_n_steps is not None:
        raise MisconfigurationError("Trainer(barebones=True) logs nothing; remove log_every_n_steps.")

    fast_dev_run = args.fast_dev_run
    if isinstance(fast_dev_run, bool):
        fast_dev_run = int(fast_dev_run)
    if not isinstance(fast_dev_run, int) or fast_dev_run < 0:
        raise MisconfigurationError(f"fast_dev_run={args.fast_dev_run!r}; use True or an int >= 0 (batches).")

    val_check_interval = args.val_check_interval
    if isinstance(val_check_interval, (str, dict, datetime.timedelta)):
        raise MisconfigurationError(
            f"val_check_interval={val_check_interval!r} (a time interval) is not supported: validating when a time "
            "has passed would run validation at a different batch on every rerun. Pass an int (batches) or a "
            "float (fraction of an epoch)."
        )
    val_check_interval = check_limit("val_check_interval", val_check_interval)

    overfit = check_limit("overfit_batches", args.overfit_batches or 0.0)
    limits = {"train": check_limit("limit_train_batches", args.limit_train_batches),
              "val": check_limit("limit_val_batches", args.limit_val_batches),
              "test": check_limit("limit_test_batches", args.limit_test_batches),
              "predict": check_limit("limit_predict_batches", args.limit_predict_batches)}
    sanity = args.num_sanity_val_steps
    sanity = (0 if barebones else 2) if sanity is None else sanity
    if isinstance(sanity, bool) or not isinstance(sanity, int) or sanity < -1:
        raise MisconfigurationError(f"num_sanity_val_steps={sanity!r}; use an int >= 0, or -1 for all batches.")
    sanity_steps: int | float = float("inf") if sanity == -1 else sanity
    log_every = 50 if args.log_every_n_steps is None else args.log_every_n_steps
    if log_every < 1:
        raise MisconfigurationError(f"log_every_n_steps must be >= 1, got {log_every}.")

    max_epochs, max_steps = args.max_epochs, args.max_steps
    check_every = args.check_val_every_n_epoch
    logger = args.logger
    if logger is None:
        logger = not barebones
    if fast_dev_run:
        if not overfit:
            limits["train"] = limits["val"] = fast_dev_run
        limits["test"] = limits["predict"] = fast_dev_run
        max_steps, max_epochs, sanity_steps = fast_dev_run, 1, 0
        val_check_interval, check_every = 1.0, 1
        logger = False
    if overfit:
        limits["train"] = limits["val"] = overfit

    algorithm = args.gradient_clip_algorithm
    algorithm = "norm" if algorithm is None else str(algorithm).lower()
    if algorithm not in ("norm", "value"):
        raise MisconfigurationError(
            f"gradient_clip_algorithm={args.gradient_clip_algorithm!r}; use 'norm' or 'value'."
        )
    for name, value, least in (("max_epochs", args.max_epochs, -1), ("min_epochs", args.min_epochs, 0)):
        if value is not None and value < least:
            raise MisconfigurationError(f"{name} must be >= 0 (or -1 for max_epochs: no limit), got {value}.")

    refuse_plugins(args.plugins)
    if args.model_registry is not None:
        raise MisconfigurationError(
            f"model_registry={args.model_registry!r} is not supported: phalanx uploads nothing. Remove it and copy "
            "the checkpoint (ModelCheckpoint.best_model_path) to your registry yourself."
        )
    accumulate, reload_every = args.accumulate_grad_batches, args.reload_dataloaders_every_n_epochs
    if accumulate < 1:
        raise MisconfigurationError(f"accumulate_grad_batches must be >= 1, got {accumulate}.")
    if reload_every < 0:
        raise MisconfigurationError(f"reload_dataloaders_every_n_epochs must be >= 0, got {reload_every}.")
    deterministic, benchmark = args.deterministic, args.benchmark
    if deterministic not in (None, True, False, "warn"):
        raise MisconfigurationError(f"deterministic={deterministic!r}; use True, False or 'warn'.")
    if benchmark and deterministic:
        raise MisconfigurationError("benchmark=True picks kernels by speed, which deterministic=True forbids.")
    # Lightning: no max_epochs means 1000 epochs, unless max_steps bounds the run; -1 means no limit.
    if max_epochs is None or max_epochs == -1:
        max_epochs = (1000 if max_steps < 0 else sys.maxsize) if max_epochs is None else sys.maxsize
    root = args.default_root_dir

    def flag(value: bool | None) -> bool:
        return (not barebones) if value is None else bool(value)

    return Settings(
        max_epochs=max_epochs, min_epochs=args.min_epochs, max_steps=max_steps, min_steps=args.min_steps,
        limit_train_batches=limits["train"], limit_val_batches=limits["val"], limit_test_batches=limits["test"],
        limit_predict_batches=limits["predict"], overfit_batches=overfit, val_check_interval=val_check_interval,
        check_val_every_n_epoch=check_every, num_sanity_val_steps=sanity_steps, log_every_n_steps=log_every,
        fast_dev_run=fast_dev_run, enable_checkpointing=flag(args.enable_checkpointing) and not fast_dev_run,
        enable_progress_bar=flag(args.enable_progress_bar), enable_model_summary=flag(args.enable_model_summary),
        logger=logger, accumulate_grad_batches=accumulate, gradient_clip_val=args.gradient_clip_val,
        gradient_clip_algorithm=algorithm, gradient_clip_algorithm_given=args.gradient_clip_algorithm is not None,
        deterministic=deterministic, benchmark=benchmark, inference_mode=bool(args.inference_mode),
        use_distributed_sampler=bool(args.use_distributed_sampler), sync_batchnorm=bool(args.sync_batchnorm),
        reload_dataloaders_every_n_epochs=reload_every, enable_autolog_hparams=bool(args.enable_autolog_hparams),
        barebones=barebones, default_root_dir=Path(root) if root is not None else Path.cwd(),
    )


def refuse_plugins(plugins: Any) -> None:
    """``plugins=`` is refused: every kind Lightning accepts has a phalanx equivalent elsewhere."""
    if plugins is None or plugins == []:
        return
    raise MisconfigurationError(
        f"plugins={plugins!r} is not supported. phalanx has no plugin objects: choose the precision with "
        "precision=..., the cluster environment is detected from torchrun/SLURM/`phalanx run`, checkpoint I/O "
        "belongs to the strategy (pass a Strategy instance with its options), and SyncBatchNorm is "
        "sync_batchnorm=True."
    )


def check_weights_only(weights_only: bool | None) -> None:
    if weights_only is False:
        raise MisconfigurationError(
            "weights_only=False is refused: phalanx opens checkpoints with its own safe reader. Leave it unset."
        )


def split_datamodule(dataloaders: Any, datamodule: DataModule | None) -> tuple[Any, DataModule | None]:
    """A datamodule passed where the dataloaders go (Lightning allows it)."""
    from phalanx.core.datamodule import DataModule

    if isinstance(dataloaders, DataModule):
        if datamodule is not None:
            raise MisconfigurationError("Got two datamodules (dataloaders= and datamodule=); pass one.")
        return None, dataloaders
    if dataloaders is not None and datamodule is not None:
        raise MisconfigurationError("Got both dataloaders and a datamodule; pass one source of data.")
    return dataloaders, datamodule


def sequential(loader: Any) -> Any:
    """overfit_batches: the same first batches every epoch, so the training loader must not shuffle."""
    from torch.utils.data import DataLoader, RandomSampler

    from phalanx.trainer.loaders import rebuild_loader

    if isinstance(loader, DataLoader) and isinstance(loader.sampler, RandomSampler):
        diagnostics.warn("overfit_batches: the training dataloader shuffles; phalanx reads it in order instead.")
        return rebuild_loader(loader, batch_size=loader.batch_size, shuffle=False, drop_last=loader.drop_last)
    return loader


def off_in_fast_dev_run(callback: Any) -> bool:
    """Callbacks that checkpoint, stop or tune: fast_dev_run is a smoke test, they sit it out. Each such
    callback says so itself (``skip_in_fast_dev_run = True``, see :class:`phalanx.callbacks.Callback`), so
    the Trainer need not know the callbacks of the layers above it (the tuner's)."""
    return bool(getattr(callback, "skip_in_fast_dev_run", False))


def checkpoint_marks(callback: Any) -> tuple[Any, ...] | None:
    """What changes when a ModelCheckpoint writes a file (None for other callbacks)."""
    if not hasattr(callback, "best_model_path") or not hasattr(callback, "last_model_path"):
        return None
    return (callback.best_model_path, callback.last_model_path, tuple(getattr(callback, "best_k_models", {})),
            tuple(getattr(callback, "kept_model_paths", ())))


@contextlib.contextmanager
def deterministic(mode: bool | str | None, benchmark: bool | None) -> Iterator[None]:
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


def refuse_batch_transfer_hooks(module: Module, datamodule: DataModule | None) -> None:
    """Lightning's batch-transfer hooks are refused rather than silently skipped: phalanx moves batches to the
    device inside its data loaders."""
    from phalanx.core.module import overrides

    for owner in (module, datamodule):
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


def check_manual_optimization(module: Module, strategy: Any, settings: Settings) -> None:
    """Manual optimization (``automatic_optimization = False``) refuses what only automatic optimization does,
    and strategies whose forward gathers the parameters."""
    if module.automatic_optimization:
        return
    if not strategy.supports_calls_outside_forward:
        raise MisconfigurationError(
            f"Manual optimization (automatic_optimization = False) is not supported with strategy="
            f"{strategy.name!r}: training_step runs outside the strategy's forward so that every "
            "manual_backward is synchronized, and this strategy gathers its parameters in that forward. Use "
            "automatic optimization, strategy='ddp', or a Fabric loop."
        )
    if settings.accumulate_grad_batches != 1:
        raise MisconfigurationError(
            "accumulate_grad_batches is for automatic optimization; with automatic_optimization = False, "
            "accumulate in training_step (step the optimizer every N batches) and remove the argument."
        )
    if settings.gradient_clip_val is not None:
        raise MisconfigurationError(
            "gradient_clip_val is for automatic optimization; with automatic_optimization = False call "
            "self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm=...) before "
            "optimizer.step() and remove the Trainer argument."
        )
