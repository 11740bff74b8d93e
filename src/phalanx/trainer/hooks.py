"""How the Trainer calls Lightning's hooks: on every callback that defines one, then on the Module.

The failures this prevents: a ported callback or Module hook that silently never runs, a hook that
reads ``trainer.callback_metrics`` on one rank while the others wait in the sync it triggers (step
values are synced before any user hook that could read them, on every rank), and a checkpoint that
an MLflow/W&B logger never hears about. Dispatch is also the Trainer's hottest code after the step
itself: callbacks' methods are looked up once per hook and callback list, the Module's no-op
defaults are not called, and the training batch asks ``hook_does_something`` once per epoch
(:class:`phalanx.trainer.stepping.StepPlan`) instead of dispatching at every batch.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from phalanx.core.module import overrides
from phalanx.trainer.board import reads_metrics
from phalanx.trainer.settings import checkpoint_marks, off_in_fast_dev_run
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.module import Module
    from phalanx.fabric.fabric import Fabric
    from phalanx.profilers import Profiler
    from phalanx.trainer.settings import Settings


class TrainerHooks:
    """Mixed into :class:`phalanx.Trainer`; reads the attributes declared below."""

    fabric: Fabric
    settings: Settings
    callbacks: list[Any]
    profiler: Profiler
    _hook_methods: dict[str, tuple[tuple[Any, ...], list[tuple[Any, Any]]]]
    _no_op_hooks: frozenset[str]

    if TYPE_CHECKING:
        @property
        def module(self) -> Module: ...
        @property
        def is_global_zero(self) -> bool: ...
        @property
        def world_size(self) -> int: ...
        @property
        def loggers(self) -> list[Any]: ...
        def sync_step_metrics(self) -> None: ...

    def call(self, hook: str, *args: Any) -> None:
        """Call ``hook(trainer, module, *args)`` on every callback that defines it."""
        for cb, method in self._callback_methods(hook):
            if self.settings.fast_dev_run and off_in_fast_dev_run(cb):
                continue
            if reads_metrics(method):  # user code may read callback_metrics on one rank only
                self.sync_step_metrics()
            saved = checkpoint_marks(cb)
            with self.profile(f"[Callback]{type(cb).__qualname__}.{hook}"):
                method(self, self.module, *args)
            if saved is not None and saved != checkpoint_marks(cb):
                self._after_save_checkpoint(cb)

    def _callback_methods(self, hook: str) -> list[tuple[Any, Any]]:
        """The callbacks defining ``hook``, with the method: looked up once per hook and list of callbacks
        (hooks run several times per step, and most callbacks define few of them)."""
        callbacks = tuple(self.callbacks)
        cached = self._hook_methods.get(hook)
        if cached is not None and cached[0] == callbacks:  # the same callback objects (identity first)
            return cached[1]
        from phalanx.callbacks import Callback

        found = []
        for cb in callbacks:
            method = getattr(cb, hook, None)
            # Callback's own no-op (a hook the subclass did not override) need not be called.
            if callable(method) and getattr(method, "__func__", None) is not getattr(Callback, hook, None):
                found.append((cb, method))
        self._hook_methods[hook] = (callbacks, found)
        return found

    def hook(self, name: str, *args: Any) -> Any:
        """A Lightning hook: every callback's ``name(trainer, module, *args)``, then the module's
        ``name(*args)`` (whose return value is returned)."""
        if self._callback_methods(name):
            self.call(name, *args)
        module = self.module
        if overrides(module, name):
            self.sync_step_metrics()  # the user's hook may read callback_metrics (on one rank only)
        elif name in self._no_op_hooks:
            return None  # several per step: the default does nothing
        with self.profile(f"[LightningModule]{type(module).__name__}.{name}"):
            return getattr(module, name)(*args)

    def hook_does_something(self, name: str) -> bool:
        """Whether ``hook(name)`` would call anything: a callback defining it, or the Module's own
        (overridden, or a default with a body)."""
        return bool(self._callback_methods(name)) or overrides(self.module, name) or name not in self._no_op_hooks

    def profile(self, action: str) -> contextlib.AbstractContextManager[Any]:
        """Measure ``action`` with the Trainer's profiler (a no-op without one)."""
        return self.profiler.profile(action)

    def _after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Loggers that track checkpoints (MLflow, W&B) hear about each one ModelCheckpoint wrote."""
        if not self.is_global_zero:
            return
        for lg in self.loggers:
            after = getattr(lg, "after_save_checkpoint", None)
            if callable(after):
                after(checkpoint_callback)

    def batch_start(self, batch: Any, batch_idx: int) -> bool:
        """``on_train_batch_start``; returns False when the module asked (by returning -1) to end the
        epoch here. Several ranks must agree, or they would fall out of step: they are asked together."""
        answer = self.hook("on_train_batch_start", batch, batch_idx)
        if not overrides(self.module, "on_train_batch_start"):
            return True
        stop = answer == -1
        if self.world_size > 1:
            votes = self.fabric.all_gather(torch.tensor(int(stop)))
            if int(votes.min()) != int(votes.max()):
                raise MisconfigurationError(
                    f"on_train_batch_start returned -1 on some ranks but not others at batch {batch_idx}; every rank "
                    "must end the epoch at the same batch. Base the decision on values that agree across ranks."
                )
        return not stop
