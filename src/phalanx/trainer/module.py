"""``phalanx.Module`` and ``phalanx.DataModule``: the code the Trainer calls.

A Module is an ``nn.Module`` with a few extra methods. The Trainer calls the ``*_step`` methods
through the set-up model (so DDP/FSDP see them as a forward pass) and every other hook on the module
itself. The hook set is deliberately small; anything else belongs in a callback.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.fabric import Fabric
    from phalanx.trainer.trainer import Trainer

REDUCE_FX = ("mean", "sum", "max", "min")


class Module(nn.Module):
    """Subclass this, implement ``training_step`` and ``configure_optimizers``, hand it to a Trainer."""

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self.hparams: dict[str, Any] = {}

    # ------------------------------------------------------------------ links to the trainer
    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise MisconfigurationError(
                f"{type(self).__name__} is not attached to a Trainer. Pass it to trainer.fit/validate/test/"
                "predict first (self.log, self.trainer and self.fabric only work inside those calls)."
            )
        return self._trainer

    @property
    def fabric(self) -> Fabric:
        return self.trainer.fabric

    @property
    def device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def global_step(self) -> int:
        return self.trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self.trainer.current_epoch if self._trainer is not None else 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self._trainer is None or self._trainer.is_global_zero:
            print(*args, **kwargs)

    def save_hyperparameters(self, *names: str, **values: Any) -> None:
        """Record hyperparameters in ``self.hparams`` (sent to loggers and stored in checkpoints).

        With no arguments, records every argument of the calling ``__init__``; with names, only those.
        """
        if values:
            self.hparams.update(values)
            return
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:
            raise MisconfigurationError("save_hyperparameters() could not see its caller; pass values as kwargs.")
        local = dict(caller.f_locals)
        local.pop("self", None)
        local.pop("__class__", None)
        chosen = names or tuple(local)
        missing = [n for n in chosen if n not in local]
        if missing:
            raise MisconfigurationError(f"save_hyperparameters: {missing} are not arguments of the caller.")
        self.hparams.update({n: local[n] for n in chosen})

    # ------------------------------------------------------------------ steps (override these)
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Return the loss tensor (or a dict with a ``"loss"`` key)."""
        raise MisconfigurationError(f"{type(self).__name__} must implement training_step(batch, batch_idx).")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise MisconfigurationError(
            f"Validation data was given but {type(self).__name__} does not implement validation_step(batch, "
            "batch_idx). Implement it, or do not pass validation dataloaders."
        )

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        raise MisconfigurationError(f"trainer.test() needs {type(self).__name__}.test_step(batch, batch_idx).")

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """Default: ``self(batch)`` (or ``self(batch[0])`` for ``(inputs, targets)`` batches)."""
        if isinstance(batch, (list, tuple)) and batch:
            return self(batch[0])
        return self(batch)

    def configure_optimizers(self) -> Any:
        """Return an optimizer, or ``{"optimizer": opt, "lr_scheduler": sched_or_config}``, or
        ``([opt], [sched])``. A scheduler config is a dict with ``scheduler``, ``interval`` ("step" or
        "epoch"), ``frequency`` and, for ReduceLROnPlateau, ``monitor``."""
        raise MisconfigurationError(f"{type(self).__name__} must implement configure_optimizers() for fit().")

    # ------------------------------------------------------------------ logging
    def log(
        self,
        name: str,
        value: Any,
        *,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        prog_bar: bool = False,
        logger: bool = True,
        sync_dist: bool = False,
        reduce_fx: str | Any = "mean",
        batch_size: int | None = None,
    ) -> None:
        """Record a scalar metric: a number, a one-element tensor, or a torchmetrics ``Metric``.

        Defaults: in training, ``on_step=True, on_epoch=False``; in validation/test, ``on_step=False,
        on_epoch=True``. Epoch values are exact: means are weighted by batch size (inferred from the
        batch, or ``batch_size=``). ``sync_dist=True`` reduces across ranks; without it, the value of
        rank 0 is used on every rank, so ``trainer.callback_metrics`` is always identical everywhere.
        ``reduce_fx``: "mean", "sum", "max" or "min" (or torch.mean/sum/max/min).

        A ``Metric`` (an attribute of this module, e.g. ``self.acc(preds, y); self.log("acc", self.acc)``)
        logs its forward value on steps and ``compute()`` at epoch end, after which it is ``reset()``;
        torchmetrics reduces it across ranks itself, so ``sync_dist``/``reduce_fx`` do not apply.
        Logging never communicates; values are synced across ranks where they are read.
        """
        self.trainer.results_for_logging().log(
            name, value, on_step=on_step, on_epoch=on_epoch, prog_bar=prog_bar, logger=logger,
            sync_dist=sync_dist, reduce_fx=reduce_fx, batch_size=batch_size, module=self,
        )

    def log_dict(self, metrics: Mapping[str, Any] | Any, **kwargs: Any) -> None:
        """``self.log`` for each item of a dict or a torchmetrics ``MetricCollection`` (its prefixed names)."""
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    # ------------------------------------------------------------------ hooks (all optional)
    def setup(self, stage: str) -> None:
        """Called on every rank at the start of fit/validate/test/predict, before the model is set up."""

    def teardown(self, stage: str) -> None:
        """Called at the end of fit/validate/test/predict."""

    def on_fit_start(self) -> None: ...

    def on_fit_end(self) -> None: ...

    def on_train_epoch_start(self) -> None: ...

    def on_train_epoch_end(self) -> None:
        """May call ``self.log``; those values count as epoch-level."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None: ...

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...

    def on_validation_epoch_start(self) -> None: ...

    def on_validation_epoch_end(self) -> None:
        """May call ``self.log``; those values count as epoch-level."""

    def on_test_epoch_start(self) -> None: ...

    def on_test_epoch_end(self) -> None: ...

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Once per real optimizer step, after the last micro-batch's backward, before clipping."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Run the optimizer step (once per accumulation window); override for e.g. manual warm-up."""
        optimizer.step()

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add entries to ``checkpoint`` (plain picklable values)."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read the entries ``on_save_checkpoint`` added."""


class DataModule:
    """Optional: the data of a task in one object. Override the loaders you need."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def prepare_data(self) -> None:
        """Download or write files. Runs on local rank 0 of each node, before the others call setup."""

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

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def overrides(module: Module, name: str) -> bool:
    """Whether ``module``'s class defines its own ``name`` (rather than Module's default)."""
    return getattr(type(module), name, None) is not getattr(Module, name, None)


def check_reduce_fx(reduce_fx: Any) -> str:
    """Normalize ``reduce_fx`` to one of REDUCE_FX."""
    named = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min", max: "max", min: "min",
             sum: "sum"}
    if isinstance(reduce_fx, str) and reduce_fx in REDUCE_FX:
        return reduce_fx
    if callable(reduce_fx) and reduce_fx in named:
        return named[reduce_fx]
    raise MisconfigurationError(
        f"reduce_fx={reduce_fx!r} is not supported; use one of {REDUCE_FX} (or torch.mean/sum/max/min)."
    )
