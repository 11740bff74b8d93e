"""One training batch under automatic or manual optimization, with Lightning's hook protocol.

The failures this prevents: a ported ``optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)``
override that never runs the batch's training_step (the closure), a ``global_step`` that counts
batches instead of optimizer steps, and manual optimization (``self.manual_backward``,
``opt.step()``) that bypasses the strategy's gradient sync or its checks.

Automatic optimization, one accumulation window of N micro-batches:

* window start: ``on_before_zero_grad`` then ``optimizer_zero_grad(epoch, batch_idx, optimizer)``;
* each micro-batch but the last: training_step and backward (gradient sync skipped);
* the last: ``optimizer_step(epoch, batch_idx, optimizer, closure)``; the closure runs training_step,
  backward (synced), ``on_before_optimizer_step`` and ``configure_gradient_clipping``; the real step
  counts one ``global_step``; step-interval schedulers then step.

Manual optimization: training_step runs once per batch and does the rest itself; each real
``opt.step()`` counts one ``global_step`` (two optimizers stepped per batch count two, as in
Lightning), and schedulers are stepped by the user. Every ``manual_backward`` leaves gradients
averaged across ranks (see ``train_batch``); validated on the single-device and DDP strategies.

This module sits below the Trainer class in its package (the Trainer creates StepOptimizers and
forwards the Module's ``manual_backward``/``clip_gradients`` here), so every function and class takes
the parts of the Trainer it uses, never the Trainer. The counters it bumps are the Trainer's
:class:`~phalanx.trainer.state.LoopState`, held by the plan and by each optimizer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from phalanx.core.module import overrides
from phalanx.core.optimizers import step_schedulers
from phalanx.core.toggling import Toggleable, toggle_params, untoggle_params
from phalanx.fabric.wrappers import FabricOptimizer
from phalanx.profilers import PassThroughProfiler
from phalanx.trainer.loss_check import LossCheck
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.module import Module
    from phalanx.core.optimizers import SchedulerConfig
    from phalanx.fabric.fabric import Fabric
    from phalanx.profilers import Profiler
    from phalanx.trainer.hooks import HookDispatcher
    from phalanx.trainer.settings import Settings
    from phalanx.trainer.state import LoopState


class StepOptimizer:
    """What ``self.optimizers()`` returns (Lightning's LightningOptimizer): the set-up optimizer whose
    ``step(closure=None)`` runs ``closure`` first, then the strategy's step, and counts a global step."""

    def __init__(self, optimizer: FabricOptimizer, fabric: Fabric, model: Any, module: Module,
                 all_optimizers: list[Any], state: LoopState, hooks: HookDispatcher) -> None:
        for name, value in (("_fabric_optimizer", optimizer), ("_fabric", fabric), ("_model", model),
                            ("_module", module), ("_all", all_optimizers), ("_state", state), ("_hooks", hooks),
                            ("_profiler", hooks.profiler), ("_profiled", profiling(hooks.profiler))):
            object.__setattr__(self, name, value)
        raw = optimizer.optimizer
        # An instance of the user's optimizer class too, so isinstance checks in ported code hold.
        object.__setattr__(self, "__class__", type("Step" + type(raw).__name__, (StepOptimizer, type(raw)), {}))

    @property
    def fabric_optimizer(self) -> FabricOptimizer:
        """The set-up optimizer this one steps through."""
        return self._fabric_optimizer  # type: ignore[no-any-return]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's torch optimizer."""
        raw: torch.optim.Optimizer = self._fabric_optimizer.optimizer
        return raw

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        if not self._module.automatic_optimization:
            # In automatic optimization the closure already ran this hook (before clipping).
            self._hooks.run("on_before_optimizer_step", self)
        self.step_and_count(**kwargs)
        return result

    def step_and_count(self, **kwargs: Any) -> None:
        """The strategy's step (profiled as ``optimizer_step``), counted as one ``global_step``."""
        # Looked up at each call: a scheduler created on the set-up optimizer wraps its step.
        if self._profiled:
            timed(self._profiler, "optimizer_step", self._fabric_optimizer.step)(**kwargs)
        else:
            self._fabric_optimizer.step(**kwargs)
        self._state.global_step += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._fabric_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self._fabric_optimizer.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._fabric_optimizer.load_state_dict(state_dict)

    def toggle_model(self, sync_grad: bool = True) -> Any:
        """Within the block only this optimizer's parameters require grad; ``sync_grad=False`` also skips
        gradient sync (accumulating in manual optimization)."""
        module = self._module

        @contextlib.contextmanager
        def block() -> Iterator[None]:
            toggle(self._all, module, self)
            try:
                with self._fabric.no_backward_sync(self._model, enabled=not sync_grad):
                    yield
            finally:
                untoggle_params(module)

        return block()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fabric_optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fabric_optimizer, name, value)

    def __repr__(self) -> str:
        return f"StepOptimizer({self.optimizer!r})"


def _raw(optimizer: Any) -> torch.optim.Optimizer:
    if isinstance(optimizer, (StepOptimizer, FabricOptimizer)):
        return optimizer.optimizer
    raw: torch.optim.Optimizer = optimizer
    return raw


def toggle(optimizers: list[Any], module: Toggleable, optimizer: Any) -> None:
    """``toggle_optimizer``: freeze every parameter of the other ``optimizers`` (remembering
    requires_grad) so only ``optimizer``'s parameters get gradients."""
    toggle_params(module, _raw(optimizer), [_raw(opt) for opt in optimizers])


def run_backward(fabric: Fabric, model: Any, hooks: HookDispatcher, loss: torch.Tensor, *args: Any,
                 **kwargs: Any) -> None:
    """``manual_backward``: the backward hooks around ``fabric.backward`` through the set-up model."""
    hooks.run("on_before_backward", loss)
    with hooks.profile("backward"):
        fabric.backward(loss, *args, model=model, **kwargs)
    hooks.run("on_after_backward")


def clip(settings: Settings, fabric: Fabric, model: Any, optimizer: Any, value: float | None,
         algorithm: str | None) -> None:
    """``self.clip_gradients``: Lightning's rules (the Trainer's settings fill what is not given and
    may not be contradicted; 0 means no clipping)."""
    if value is None:
        value = settings.gradient_clip_val or 0.0
    elif settings.gradient_clip_val is not None and settings.gradient_clip_val != value:
        raise MisconfigurationError(
            f"clip_gradients(gradient_clip_val={value}) contradicts Trainer(gradient_clip_val="
            f"{settings.gradient_clip_val}); set it in one place."
        )
    given = algorithm.lower() if algorithm is not None else None
    if given is not None and settings.gradient_clip_algorithm_given and given != settings.gradient_clip_algorithm:
        raise MisconfigurationError(
            f"clip_gradients(gradient_clip_algorithm={algorithm!r}) contradicts Trainer(gradient_clip_algorithm="
            f"{settings.gradient_clip_algorithm!r}); set it in one place."
        )
    algorithm = given or settings.gradient_clip_algorithm
    if algorithm not in ("norm", "value"):
        raise MisconfigurationError(f"gradient_clip_algorithm={algorithm!r}; use 'norm' or 'value'.")
    if not value:
        return
    fabric_opt: Any = optimizer.fabric_optimizer if isinstance(optimizer, StepOptimizer) else optimizer
    if algorithm == "norm":
        fabric.clip_gradients(model, fabric_opt, max_norm=value, error_if_nonfinite=False)
    else:
        fabric.clip_gradients(model, fabric_opt, clip_val=value)


# The hooks of one training batch (Lightning's order), each dispatched to the callbacks and the Module.
STEP_HOOKS = ("on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
              "on_before_optimizer_step", "on_train_batch_end")


class StepPlan:
    """What one training batch has to call, decided once per epoch, and the parts of the Trainer it calls.

    The step protocol is Lightning's (above): six hooks, each for every callback and the Module, a
    closure through ``optimizer_step``, clipping through ``configure_gradient_clipping``, a profiler
    bracket around each part. Asking at every batch which of these does anything would cost more than
    the rest of the Trainer's step together, so the questions are answered here, at the start of each
    epoch, and the step calls only what does something: a hook some callback defines or the Module
    overrides (or whose Module default has a body); clipping where a value is set or the Module
    customises it; where the Module keeps a default whose whole body is one call (``backward``,
    ``optimizer_zero_grad``, ``optimizer_step``), that call; profiler brackets with a profiler.
    Consequence, documented in docs/trainer.md: callbacks added, or Module methods replaced, in the
    middle of an epoch take part from the next epoch on.

    ``accumulate``: this epoch's entry of the Trainer's accumulation schedule. ``window``: the current
    window's losses, checked by ``loss_check`` before its step. ``metrics``/``sync_metrics``: the
    Trainer's ``callback_metrics`` and its step-value sync (for a monitored scheduler, a custom
    ``optimizer_step``).
    """

    __slots__ = ("accumulate", "automatic", "backward", "clip", "clip_algorithm", "clip_val", "custom_step",
                 "custom_zero_grad", "fabric", "hooks", "live", "loss_check", "metrics", "model", "module",
                 "optimizer", "run_accumulating", "run_boundary", "schedulers", "state", "sync_metrics",
                 "training_step", "window")
    run_boundary: Callable[..., tuple[Any, torch.Tensor]]  # (training_step's output, its loss)
    run_accumulating: Callable[..., tuple[Any, torch.Tensor]]

    def __init__(self, *, module: Module, model: Any, fabric: Fabric, settings: Settings, state: LoopState,
                 hooks: HookDispatcher, accumulate: int, optimizers: list[StepOptimizer], loss_check: LossCheck,
                 window: list[tuple[int, torch.Tensor]], schedulers: list[SchedulerConfig],
                 metrics: Callable[[], dict[str, torch.Tensor]], sync_metrics: Callable[[], None]) -> None:
        self.module, self.model, self.fabric, self.state, self.hooks = module, model, fabric, state, hooks
        self.automatic = module.automatic_optimization
        self.optimizer = optimizers[0] if self.automatic else None
        self.accumulate = accumulate
        self.loss_check, self.window, self.schedulers = loss_check, window, schedulers
        self.metrics, self.sync_metrics = metrics, sync_metrics
        self.live = frozenset(name for name in STEP_HOOKS if hooks.does_something(name))
        self.clip_val, self.clip_algorithm = settings.gradient_clip_val, settings.gradient_clip_algorithm
        self.clip = clips(module, self.clip_val)
        self.custom_zero_grad = overrides(module, "optimizer_zero_grad")
        self.custom_step = overrides(module, "optimizer_step")
        profiler = hooks.profiler
        # The set-up model's redirect runs the method as the strategy's forward (DDP arms its reducer);
        # it finds the method at each call, so only the attribute lookup is saved.
        self.training_step = timed(profiler, f"[LightningModule]{type(module).__name__}.training_step",
                                   model.training_step)
        self.backward = timed(profiler, "backward", module.backward if overrides(module, "backward")
                              else functools.partial(fabric.backward, model=model))
        self.run_boundary = timed(profiler, "run_training_batch", _forward_backward)
        self.run_accumulating = timed(profiler, "run_training_batch", _forward_backward_no_sync)


def clips(module: Module, clip_val: float | None) -> bool:
    """Whether a step calls ``configure_gradient_clipping``: a clipping value is set, or the Module clips
    its own way."""
    return bool(clip_val) or overrides(module, "configure_gradient_clipping") or overrides(module, "clip_gradients")


def profiling(profiler: Profiler) -> bool:
    """Whether ``profiler`` records anything."""
    return type(profiler) is not PassThroughProfiler


def timed(profiler: Profiler, action: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` measured as ``action`` by ``profiler``; without one that records, ``fn`` itself (no bracket
    to enter and leave, several times per step)."""
    if not profiling(profiler):
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        with profiler.profile(action):
            return fn(*args, **kwargs)

    return run


def train_batch(plan: StepPlan, batch: Any, batch_idx: int, window_size: int, boundary: bool) -> Any:
    """Run one training batch (and the optimizer step it completes); returns training_step's output
    (``as_outputs`` makes it what ``on_train_batch_end`` receives, where some hook does)."""
    module = plan.module
    optimizer = plan.optimizer
    if optimizer is None:
        # Not through the set-up model's forward: manual_backward runs INSIDE training_step, i.e. inside
        # that forward, before DDP's reducer is prepared for it, so DDP would not reduce those gradients
        # (and would then wait for a backward that never comes). Called directly, every manual_backward
        # takes the strategy's other path: the gradients it produced are averaged across ranks right
        # after it, however many backward passes and toggled optimizers the step has.
        with plan.hooks.profile("run_training_batch"), plan.fabric.autocast():
            return module.training_step(batch, batch_idx)
    live = plan.live
    state = plan.state
    window = plan.window
    if batch_idx % plan.accumulate == 0 or not window:  # a window's first micro-batch (see windows())
        window.clear()
        if "on_before_zero_grad" in live:
            plan.hooks.run("on_before_zero_grad", optimizer)
        if plan.custom_zero_grad:
            module.optimizer_zero_grad(state.current_epoch, batch_idx, optimizer)
        else:
            optimizer.fabric_optimizer.zero_grad()
    if not boundary:
        output, loss = plan.run_accumulating(plan, batch, batch_idx, window_size)
        window.append((batch_idx, loss.detach()))
        return output
    steps_before = state.global_step
    if not plan.custom_step:
        # The default optimizer_step is optimizer.step(closure=closure): run the closure's body, then step.
        output = _last_micro_batch(plan, optimizer, batch, batch_idx, window_size)[0]
        optimizer.step_and_count()
        plan.loss_check.stepped(optimizer.optimizer)
    else:
        ran: list[Any] = []

        def closure() -> torch.Tensor:
            output, loss = _last_micro_batch(plan, optimizer, batch, batch_idx, window_size)
            ran.append(output)
            return loss

        plan.sync_metrics()  # the user's override may read callback_metrics (on one rank only)
        module.optimizer_step(state.current_epoch, batch_idx, optimizer, closure)
        plan.loss_check.stepped(optimizer.optimizer)
        if not ran:
            raise MisconfigurationError(
                f"{type(module).__name__}.optimizer_step did not run its optimizer_closure, so this batch's "
                "training_step and backward never happened. Call optimizer.step(closure=optimizer_closure), or "
                "optimizer_closure() before stepping."
            )
        output = ran[0]
    configs = plan.schedulers
    if configs and state.global_step > steps_before:
        # Reading callback_metrics syncs pending step values across ranks: only for a monitored scheduler.
        monitored = any(c.interval == "step" and c.monitor is not None for c in configs)
        step_schedulers(module, configs, "step", state.global_step, plan.metrics() if monitored else {})
    return output


def _last_micro_batch(
    plan: StepPlan, optimizer: StepOptimizer, batch: Any, batch_idx: int, window_size: int
) -> tuple[Any, torch.Tensor]:
    """The optimizer closure's body: the window's last forward and backward (gradients synced), then
    the checks and hooks before the step. Returns training_step's output and its loss."""
    output, loss = plan.run_boundary(plan, batch, batch_idx, window_size)
    window = plan.window
    window.append((batch_idx, loss))
    # Before any step on these gradients: read now (a CPU), or late with the step skipped on the device.
    plan.loss_check.window(window, plan.state.current_epoch, plan.state.global_step, optimizer.optimizer)
    window.clear()
    if "on_before_optimizer_step" in plan.live:
        plan.hooks.run("on_before_optimizer_step", optimizer)
    if plan.clip:
        plan.module.configure_gradient_clipping(optimizer, plan.clip_val, plan.clip_algorithm)
    return output, loss


def loss_of(output: Any) -> torch.Tensor:
    """The tensor to backpropagate from what ``training_step`` returned."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        loss = output["loss"]
    else:
        raise MisconfigurationError(
            f"training_step returned {type(output).__name__}; return the loss tensor or a dict with a 'loss' tensor. "
            "(Skipping a batch by returning None is not supported: on several ranks it would leave the others "
            "waiting in backward.)"
        )
    if loss.numel() != 1:
        raise MisconfigurationError(
            f"training_step returned a loss of shape {tuple(loss.shape)}; reduce it to a scalar."
        )
    return loss


def as_outputs(output: Any) -> Any:
    """What ``on_train_batch_end`` receives, as in Lightning: a dict (``{"loss": loss}`` for a returned
    tensor, ``{}`` for None)."""
    if output is None:
        return {}
    if isinstance(output, torch.Tensor):
        return {"loss": output}
    return output


def _forward_backward(plan: StepPlan, batch: Any, batch_idx: int, window_size: int) -> tuple[Any, torch.Tensor]:
    """Forward and backward of one micro-batch with Lightning's hooks around the module's (overridable)
    ``backward``; returns training_step's output and its loss. (The LR finder uses
    ``loops.micro_batch``, which calls the Module's hooks and no callback's.)"""
    output = plan.training_step(batch, batch_idx)
    # (The usual return, a scalar loss tensor, without a call: this runs for every micro-batch.)
    loss = output if type(output) is torch.Tensor and output.numel() == 1 else loss_of(output)
    scaled = loss / window_size if window_size > 1 else loss
    live = plan.live
    if "on_before_backward" in live:
        plan.hooks.run("on_before_backward", scaled)
    plan.backward(scaled)
    if "on_after_backward" in live:
        plan.hooks.run("on_after_backward")
    return output, loss


def _forward_backward_no_sync(plan: StepPlan, batch: Any, batch_idx: int, window_size: int) -> tuple[Any, torch.Tensor]:
    """A micro-batch before the window's last: its gradients stay local (synced with the last one's)."""
    with plan.fabric.no_backward_sync(plan.model, enabled=True):
        return _forward_backward(plan, batch, batch_idx, window_size)
