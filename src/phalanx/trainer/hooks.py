"""``HookDispatcher``: how a Trainer calls Lightning's hooks, on every callback that defines one, then on
the Module. It owns the Trainer's callback list (``trainer.callbacks``).

Contract: every hook a callback or the Module defines runs, in Lightning's order; step values are synced
across ranks before any user hook that could read ``trainer.callback_metrics`` (on one rank only, which
would otherwise leave the others waiting); loggers that track checkpoints hear about each one a
ModelCheckpoint wrote. Dispatch is the Trainer's hottest code after the step itself: a callback's methods
are looked up once per hook and callback list, the Module's no-op defaults are not called, and the
training batch asks :meth:`HookDispatcher.does_something` once per epoch
(:class:`phalanx.trainer.stepping.StepPlan`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from phalanx.core.module import no_op_hooks, overrides
from phalanx.trainer.logger_connector import reads_metrics
from phalanx.trainer.settings import checkpoint_marks, off_in_fast_dev_run
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.view import TrainerView
    from phalanx.profilers import Profiler
    from phalanx.trainer.settings import Settings


class HookDispatcher:
    """Calls ``hook(trainer, module, *args)`` on the callbacks and ``hook(*args)`` on ``trainer.module``.
    ``sync_metrics`` publishes pending step values (called before user code that may read them)."""

    def __init__(self, trainer: TrainerView, callbacks: list[Any], settings: Settings, profiler: Profiler,
                 sync_metrics: Callable[[], None]) -> None:
        self.trainer = trainer
        self.callbacks = callbacks
        self.profiler = profiler
        self._fast_dev_run = bool(settings.fast_dev_run)
        self._sync_metrics = sync_metrics
        self._methods: dict[str, tuple[tuple[Any, ...], list[tuple[Any, Any]]]] = {}
        self._no_op_hooks = no_op_hooks()

    def call(self, hook: str, *args: Any) -> None:
        """Call ``hook(trainer, module, *args)`` on every callback that defines it."""
        trainer = self.trainer
        for cb, method in self.callback_methods(hook):
            if self._fast_dev_run and off_in_fast_dev_run(cb):
                continue
            if reads_metrics(method):
                self._sync_metrics()
            saved = checkpoint_marks(cb)
            with self.profiler.profile(f"[Callback]{type(cb).__qualname__}.{hook}"):
                method(trainer, trainer.module, *args)
            if saved is not None and saved != checkpoint_marks(cb):
                self.after_save_checkpoint(cb)

    def callback_methods(self, hook: str) -> list[tuple[Any, Any]]:
        """The callbacks defining ``hook``, with the method: looked up once per hook and list of callbacks
        (hooks run several times per step, and most callbacks define few of them)."""
        callbacks = tuple(self.callbacks)
        cached = self._methods.get(hook)
        if cached is not None and cached[0] == callbacks:  # the same callback objects (identity first)
            return cached[1]
        from phalanx.callbacks import Callback

        found = []
        for cb in callbacks:
            method = getattr(cb, hook, None)
            # Callback's own no-op (a hook the subclass did not override) need not be called.
            if callable(method) and getattr(method, "__func__", None) is not getattr(Callback, hook, None):
                found.append((cb, method))
        self._methods[hook] = (callbacks, found)
        return found

    def run(self, name: str, *args: Any) -> Any:
        """A Lightning hook: every callback's ``name(trainer, module, *args)``, then the module's
        ``name(*args)``, whose return value is returned."""
        if self.callback_methods(name):
            self.call(name, *args)
        return self.run_module(name, *args)

    def run_module(self, name: str, *args: Any) -> Any:
        """The module's ``name(*args)`` alone (the tuners' steps: the Module's hooks shape the update, the
        callbacks only observe it), as :meth:`run` calls it."""
        module = self.trainer.module
        if overrides(module, name):
            self._sync_metrics()
        elif name in self._no_op_hooks:
            return None  # several per step: the default does nothing
        with self.profiler.profile(f"[LightningModule]{type(module).__name__}.{name}"):
            return getattr(module, name)(*args)

    def does_something(self, name: str) -> bool:
        """Whether ``run(name)`` would call anything: a callback defining it, or the Module's own
        (overridden, or a default with a body)."""
        return (bool(self.callback_methods(name)) or overrides(self.trainer.module, name)
                or name not in self._no_op_hooks)

    def profile(self, action: str) -> contextlib.AbstractContextManager[Any]:
        """Measure ``action`` with the Trainer's profiler (a no-op without one)."""
        return self.profiler.profile(action)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Loggers that track checkpoints (MLflow, W&B) hear about each one ModelCheckpoint wrote."""
        if not self.trainer.is_global_zero:
            return
        for lg in self.trainer.loggers:
            lg.after_save_checkpoint(checkpoint_callback)

    def batch_start(self, batch: Any, batch_idx: int) -> bool:
        """``on_train_batch_start``; False when the module returned -1 to end the epoch here. Every rank must
        agree, or they would fall out of step: with several ranks they are asked together."""
        answer = self.run("on_train_batch_start", batch, batch_idx)
        trainer = self.trainer
        if not overrides(trainer.module, "on_train_batch_start"):
            return True
        stop = answer == -1
        if trainer.world_size > 1:
            votes = trainer.fabric.all_gather(torch.tensor(int(stop)))
            if int(votes.min()) != int(votes.max()):
                raise MisconfigurationError(
                    f"on_train_batch_start returned -1 on some ranks but not others at batch {batch_idx}; every rank "
                    "must end the epoch at the same batch. Base the decision on values that agree across ranks."
                )
        return not stop
