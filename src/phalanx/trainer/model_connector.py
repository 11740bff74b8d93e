"""``ModelConnector``: the Module a Trainer runs and what was set up for it.

One owner for the user's ``module``, the set-up ``model`` (the strategy's wrapper that runs its steps), the
optimizers, the optimizers ``self.optimizers()`` returns (:class:`~phalanx.trainer.stepping.StepOptimizer`)
and the schedulers' configurations. The Trainer's attributes of those names read it, and the tuner swaps a
scratch copy of the module in through :meth:`ModelConnector.using` rather than by writing them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from phalanx.core.module import Module
from phalanx.core.optimizers import SchedulerConfig, parse_all_optimizers
from phalanx.fabric.fabric import Fabric
from phalanx.trainer.stepping import StepOptimizer
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.view import TrainerView
    from phalanx.trainer.hooks import HookDispatcher
    from phalanx.trainer.state import LoopState


class ModelConnector:
    """The module and its set-up model, optimizers and schedulers (see the module docstring). ``trainer``: what
    the module is attached to (``module.trainer``); ``sync_batchnorm``: convert BatchNorm layers at setup."""

    def __init__(self, trainer: TrainerView, fabric: Fabric, sync_batchnorm: bool, state: LoopState,
                 hooks: HookDispatcher) -> None:
        self.trainer, self.fabric, self.sync_batchnorm = trainer, fabric, sync_batchnorm
        self.state, self.hooks = state, hooks
        self.module: Module | None = None
        self.model: Any = None  # the set-up (wrapped) module
        self.optimizers: list[Any] = []  # set-up optimizers (torch.optim.Optimizer instances)
        self.step_optimizers: list[StepOptimizer] = []  # what module.optimizers() returns
        self.lr_scheduler_configs: list[SchedulerConfig] = []

    def attach(self, module: Module) -> None:
        """Run ``module`` from now on. Another module than the one set up releases that one first
        (:meth:`release`)."""
        if self.module is not None and module is not self.module and self.model is not None:
            self.release()
        self.module = module
        module.trainer = self.trainer

    def release(self) -> None:
        """Another model after an earlier stage (Lightning's ``trainer.test(other_model)`` after ``fit``): the
        strategy frees what it built for the old one (DDP's reducer, DeepSpeed's engine), and the new model is
        set up in the same processes on the same process group. Optimizers and schedulers belonged to the old
        model and go with it; the old module keeps its trained weights and can still be used on its own."""
        self.fabric.release(self.model)
        if self.module is not None:
            self.module.trainer = None
        self.model = None
        self.optimizers, self.step_optimizers, self.lr_scheduler_configs = [], [], []

    @contextlib.contextmanager
    def using(self, module: Module) -> Iterator[None]:
        """Run ``module`` (a scratch copy: the tuners search on one where the optimizer is built with its model)
        inside the block; afterwards what was set up for it is released and the attached module, model,
        optimizers and schedulers are back as they were."""
        saved = (self.module, self.model, self.optimizers, self.step_optimizers, self.lr_scheduler_configs)
        self.module, self.model = module, None
        self.optimizers, self.step_optimizers, self.lr_scheduler_configs = [], [], []
        try:
            yield
        finally:
            if self.model is not None:
                self.fabric.release(self.model)
            (self.module, self.model, self.optimizers, self.step_optimizers, self.lr_scheduler_configs) = saved

    def setup(self, optimizers: list[Any] | None = None) -> None:
        """Set up the module once; set up (new) optimizers on every call that passes some."""
        if self.model is None:
            module = self.attached()
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

    def setup_optimizers(self) -> None:
        """Call ``configure_optimizers`` and set up what it returns (again after the LR finder changed
        ``model.lr``)."""
        module = self.attached()
        optimizers, configs = parse_all_optimizers(module.configure_optimizers())
        if module.automatic_optimization and len(optimizers) != 1:
            raise MisconfigurationError(
                f"configure_optimizers returned {len(optimizers)} optimizers; automatic optimization steps exactly "
                "one. Put all parameters in one optimizer (param groups for different settings), or set "
                "self.automatic_optimization = False and step them yourself in training_step."
            )
        self.setup(optimizers)
        self.lr_scheduler_configs = configs

    def attached(self) -> Module:
        """The module (raises when there is none yet)."""
        if self.module is None:
            raise MisconfigurationError("The Trainer has no model yet: call fit/validate/test/predict with one.")
        return self.module

    def _with_sync_batchnorm(self, module: Module) -> Module:
        if self.fabric.world_size > 1 and self.fabric.device.type == "cpu":
            raise MisconfigurationError(
                "sync_batchnorm=True needs GPUs: torch's SyncBatchNorm does not run on CPU processes. Remove it, or "
                "train on CUDA devices."
            )
        torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)  # converts children in place; the root is a Module
        return module

    def _set_optimizers(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers
        self.step_optimizers = [StepOptimizer(opt, self.fabric, self.model, self.attached(), optimizers, self.state,
                                              self.hooks) for opt in optimizers]
