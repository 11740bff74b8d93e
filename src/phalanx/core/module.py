"""``phalanx.Module``: the code the Trainer calls.

A Module is an ``nn.Module`` with a few extra methods. The Trainer calls the ``*_step`` methods
through the set-up model (so DDP/FSDP see them as a forward pass) and every other hook on the module
itself (their defaults are in :mod:`phalanx.core.hooks`). The hook set is deliberately small;
anything else belongs in a callback.

The Module sits below the Trainer: it reaches its Trainer only through
:class:`phalanx.core.view.TrainerView` (``manual_backward``, ``toggle_optimizer``, ``clip_gradients``
are the Trainer's step machinery, called through that protocol), so it never imports the Trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from phalanx.core.datamodule import DataModule
from phalanx.core.hooks import DataHooks, ModelHooks
from phalanx.core.hparams import HyperparametersMixin
from phalanx.core.toggling import toggle_params, untoggle_params, unwrapped
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.view import TrainerView
    from phalanx.fabric.fabric import Fabric
    from phalanx.fabric.models import FabricLink

__all__ = ["REDUCE_FX", "Module", "check_reduce_fx", "no_op_hooks", "overrides"]

REDUCE_FX = ("mean", "sum", "max", "min")


class Module(HyperparametersMixin, ModelHooks, DataHooks):
    """Subclass this, implement ``training_step`` and ``configure_optimizers``, hand it to a Trainer.

    ``phalanx.LightningModule`` is this class: a LightningModule ports by changing its import.
    """

    # Checkpoint keys of the hyperparameters (Lightning's constants, the same keys).
    CHECKPOINT_HYPER_PARAMS_KEY = "hyper_parameters"
    CHECKPOINT_HYPER_PARAMS_NAME = "hparams_name"
    CHECKPOINT_HYPER_PARAMS_TYPE = "hparams_type"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trainer: TrainerView | None = None
        self.fabric_link: FabricLink | None = None  # set by fabric.setup() when the module runs in a Fabric loop
        self._automatic_optimization = True
        self._strict_loading: bool | None = None
        self._example_input_array: Any = None
        # The requires_grad flags toggle_optimizer changed (core/toggling.py), put back by untoggle_optimizer.
        self.toggled_requires_grad: dict[int, tuple[torch.nn.Parameter, bool]] = {}

    # ------------------------------------------------------------------ links to the trainer
    @property
    def trainer(self) -> TrainerView:
        if self._trainer is None:
            raise MisconfigurationError(
                f"{type(self).__name__} is not attached to a Trainer. Pass it to trainer.fit/validate/test/"
                "predict first (self.log, self.trainer and self.fabric only work inside those calls)."
            )
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: TrainerView | None) -> None:
        self._trainer = trainer

    @property
    def fabric(self) -> Fabric | None:
        """The Fabric running this module: the one that set it up in a Fabric loop, or the Trainer's."""
        if self.fabric_link is not None:
            return self.fabric_link.fabric  # type: ignore[no-any-return]
        return self._trainer.fabric if self._trainer is not None else None

    @property
    def device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        for p in self.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.get_default_dtype()

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def global_step(self) -> int:
        return self.trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self.trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_rank(self) -> int:
        fabric = self.fabric
        return fabric.global_rank if fabric is not None else 0

    @property
    def local_rank(self) -> int:
        fabric = self.fabric
        return fabric.local_rank if fabric is not None else 0

    @property
    def logger(self) -> Any:
        """The first logger of the Trainer, or of the Fabric that set this module up (None if none)."""
        fabric = self.fabric
        return fabric.logger if fabric is not None else None

    @property
    def loggers(self) -> list[Any]:
        fabric = self.fabric
        return fabric.loggers if fabric is not None else []

    @property
    def automatic_optimization(self) -> bool:
        """False: ``training_step`` steps the optimizers itself (``self.optimizers()``, ``self.manual_backward``)."""
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = bool(value)

    @property
    def strict_loading(self) -> bool:
        """Whether checkpoints must match the module's keys exactly (default True)."""
        return True if self._strict_loading is None else self._strict_loading

    @strict_loading.setter
    def strict_loading(self, value: bool) -> None:
        self._strict_loading = bool(value)

    @property
    def strict_loading_set(self) -> bool:
        """Whether ``strict_loading`` was set (``load_from_checkpoint(strict=...)`` may not contradict it)."""
        return self._strict_loading is not None

    @property
    def example_input_array(self) -> Any:
        """An example input; ModelSummary then shows each layer's input and output sizes."""
        return self._example_input_array

    @example_input_array.setter
    def example_input_array(self, value: Any) -> None:
        self._example_input_array = value

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    def freeze(self) -> Module:
        """``requires_grad=False`` for every parameter, and eval mode."""
        for p in self.parameters():
            p.requires_grad = False
        self.eval()
        return self

    def unfreeze(self) -> Module:
        for p in self.parameters():
            p.requires_grad = True
        self.train()
        return self

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """``fabric.all_gather`` (every tensor gains a leading world dimension)."""
        if group is not None:
            raise MisconfigurationError("all_gather(group=...) is not supported: phalanx gathers over all ranks.")
        return _fabric_of(self, "all_gather").all_gather(data, sync_grads=sync_grads)

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
        enable_graph: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
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
        if enable_graph or sync_dist_group is not None or not add_dataloader_idx or metric_attribute is not None \
                or rank_zero_only:
            _refuse_log_options(name, enable_graph, sync_dist_group, add_dataloader_idx, metric_attribute,
                                rank_zero_only)
        trainer = self._trainer
        if trainer is None:
            if self.fabric_link is not None:
                if logger:  # in a Fabric loop the loggers are the only destination
                    self.fabric_link.fabric.log(name, value)
                return
            trainer = self.trainer  # raises, saying how to attach the module
        trainer.logger_connector.sink(trainer.current_stage).log(
            name, value, on_step, on_epoch, prog_bar, logger, sync_dist, reduce_fx, batch_size, self)

    def log_dict(self, metrics: Mapping[str, Any] | Any, **kwargs: Any) -> None:
        """``self.log`` for each item of a dict or a torchmetrics ``MetricCollection`` (its prefixed names)."""
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    # ------------------------------------------------------------------ optimization (manual and automatic)
    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The set-up optimizer(s): one object, or a list when ``configure_optimizers`` returned several.

        Their ``step()`` is the real step (through the strategy's sync checks) and counts as a
        ``global_step``; with manual optimization call it yourself in ``training_step``."""
        if self._trainer is None and self.fabric_link is not None:
            opts: list[Any] = list(self.fabric_link.optimizers)
        else:
            opts = list(self.trainer.step_optimizers if use_pl_optimizer else self.trainer.optimizers)
        return opts[0] if len(opts) == 1 else opts

    def lr_schedulers(self) -> Any:
        """The scheduler(s) from ``configure_optimizers``: None, one, or a list. With manual optimization,
        step them yourself."""
        schedulers = [c.scheduler for c in self.trainer.lr_scheduler_configs]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward with loss scaling and gradient sync (use it instead of ``loss.backward()``)."""
        if self._trainer is None and self.fabric_link is not None:
            self.fabric_link.fabric.backward(loss, *args, **kwargs)
            return
        self.trainer.manual_backward(loss, *args, **kwargs)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The backward of automatic optimization (override to customise; the default is
        ``fabric.backward`` through the set-up model)."""
        if self._trainer is None and self.fabric_link is not None:
            self.fabric_link.fabric.backward(loss, *args, **kwargs)
            return
        self.trainer.fabric.backward(loss, *args, model=self.trainer.model, **kwargs)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only ``optimizer``'s parameters require grad until ``untoggle_optimizer`` (multi-optimizer loops)."""
        trainer = self._trainer
        if trainer is not None:
            trainer.toggle_optimizer(self, optimizer)
        else:  # a Fabric loop (or no runner yet): the optimizers fabric.setup gave this module
            opts = self.fabric_link.optimizers if self.fabric_link is not None else ()
            toggle_params(self, unwrapped(optimizer), [unwrapped(o) for o in opts])

    def untoggle_optimizer(self, optimizer: Any) -> None:
        trainer = self._trainer
        if trainer is not None:
            trainer.untoggle_optimizer(self)
        else:
            untoggle_params(self)

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def clip_gradients(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Clip the gradients of ``optimizer``'s parameters by total norm ("norm") or by value ("value")."""
        if self._trainer is None and self.fabric_link is not None:
            algorithm = gradient_clip_algorithm or "norm"
            if gradient_clip_val:
                if algorithm == "value":
                    self.fabric_link.fabric.clip_gradients(self, optimizer, clip_val=gradient_clip_val)
                else:
                    self.fabric_link.fabric.clip_gradients(self, optimizer, max_norm=gradient_clip_val)
            return
        self.trainer.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Called once per optimizer step (automatic optimization) with the Trainer's clipping settings."""
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Step the optimizer once per accumulation window. ``optimizer_closure`` runs the window's last
        training_step and backward (and ``on_before_optimizer_step`` and clipping): pass it on as
        ``optimizer.step(closure=optimizer_closure)``, or call it yourself before stepping."""
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Called at the start of each accumulation window (automatic optimization)."""
        optimizer.zero_grad()

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    # ------------------------------------------------------------------ data (optional, as in a DataModule)
    def prepare_data(self) -> None:
        """Download or write files. Runs on local rank 0 of each node, before the others call setup."""

    def train_dataloader(self) -> Any:
        """The training data when ``trainer.fit(model)`` is given none (and no datamodule)."""
        raise MisconfigurationError(
            f"trainer.fit() needs training data: pass train_dataloaders= or datamodule=, or implement "
            f"{type(self).__name__}.train_dataloader()."
        )

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        raise MisconfigurationError(
            f"trainer.test() needs data: pass dataloaders= or datamodule=, or implement {type(self).__name__}."
            "test_dataloader()."
        )

    def predict_dataloader(self) -> Any:
        raise MisconfigurationError(
            f"trainer.predict() needs data: pass dataloaders= or datamodule=, or implement {type(self).__name__}."
            "predict_dataloader()."
        )

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | Path,
        map_location: Any = None,
        hparams_file: str | Path | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """A new ``cls(**saved hyperparameters, **kwargs)`` with the checkpoint's weights.

        Reads a file written by ``trainer.save_checkpoint`` / ModelCheckpoint (or any file with a
        ``state_dict``/``model`` entry). ``kwargs`` override saved hyperparameters; ``hparams_file`` (YAML)
        replaces them. Call it on the class: ``MyModel.load_from_checkpoint(path)``.
        """
        from phalanx.core.loading import load_module

        # (Whether configure_model is overridden is decided here: loading.py does not import this module.)
        builds = cls.configure_model is not Module.configure_model
        return load_module(cls, checkpoint_path, map_location, hparams_file, strict, weights_only, kwargs, builds)


def _refuse_log_options(
    name: str, enable_graph: bool, group: Any, add_dataloader_idx: bool, metric_attribute: str | None,
    rank_zero_only: bool,
) -> None:
    """Lightning's other ``self.log`` options: each is refused with the reason (never ignored)."""
    reasons = []
    if enable_graph:
        reasons.append("enable_graph=True (logged values are detached: log the tensor you need and keep it yourself)")
    if group is not None:
        reasons.append("sync_dist_group (sync_dist reduces over all ranks)")
    if not add_dataloader_idx:
        reasons.append("add_dataloader_idx=False (with several loaders the names get '/dataloader_idx_N' so "
                       "they stay apart; log distinct names instead)")
    if metric_attribute is not None:
        reasons.append("metric_attribute (log the metric's computed value)")
    if rank_zero_only:
        reasons.append("rank_zero_only=True (every rank must log the same names: call self.log on every rank, "
                       "the value of rank 0 is what unsynced metrics show)")
    if reasons:
        raise MisconfigurationError(f"self.log({name!r}): not supported: " + "; ".join(reasons) + ".")


def _fabric_of(module: Module, what: str) -> Fabric:
    fabric = module.fabric
    if fabric is None:
        raise MisconfigurationError(
            f"self.{what}() needs the module to run under a Trainer (trainer.fit/...) or a Fabric (fabric.setup)."
        )
    return fabric


def no_op_hooks() -> frozenset[str]:
    """Module's hooks whose default does nothing (a body of ``...`` or a docstring): the Trainer skips
    calling them unless overridden. Read from the bytecode, so a default given a body leaves the set."""
    import dis

    nothing = ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])
    out = set()
    defaults = {**vars(ModelHooks), **vars(Module)}  # (the hooks are ModelHooks'; Module's own win)
    for name, fn in defaults.items():
        if name.startswith("on_") and callable(fn) and hasattr(fn, "__code__"):
            ops = [(i.opname, i.argval) for i in dis.get_instructions(fn) if i.opname not in ("RESUME", "NOP")]
            if ops in nothing:
                out.add(name)
    return frozenset(out)


def overrides(module: Any, name: str) -> bool:
    """Whether ``module``'s class defines its own ``name`` (rather than Module's / DataModule's default)."""
    base = DataModule if isinstance(module, DataModule) else Module
    return name in vars(module) or getattr(type(module), name, None) is not getattr(base, name, None)


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
