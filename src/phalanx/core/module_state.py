"""Everything a module holds, captured and put back exactly; and its metric state for checkpoints.

The failure this file exists to prevent: a tuning phase such as the LR finder runs ``training_step``,
which changes more than parameters and buffers. A
torchmetrics ``Metric`` keeps its state in plain attributes registered with ``add_state`` (tensors,
or lists of tensors for "cat" states) plus counters and caches (``_update_count``, ``_computed``,
``_forward_cache``); a user's step may bump a counter or stash a tensor on ``self``. Restoring only
parameters and buffers lets all of that leak into the fit (its first epoch's metrics then count the
search's batches too). :class:`ModuleRestorePoint` captures every submodule's parameters (and
gradients), buffers (persistent or not), train/eval flag, submodule table and plain attributes, and
restores them *into the same tensor objects*, so nothing changes identity or device (metric state
stays on the device the backend reduces on; DDP/FSDP keep pointing at the same parameters).

What is restored, per submodule attribute (``vars(module)`` minus ``nn.Module``'s own machinery):

* tensors: copied back in place (same object, same device);
* lists, tuples, dicts, sets (exactly those types) of restorable values: rebuilt with their original
  contents (a list or dict keeps its identity);
* numbers, strings, bytes, None, ``torch.device``/``dtype``/``Size``, enums: put back;
* ``torch.Generator`` and ``random.Random`` objects: their RNG state is put back;
* attributes the phase *added* are deleted; attributes it removed come back.

What cannot be restored is left, and said here: any other object (an optimizer or tokenizer stored
on the module, a user class instance, a dict subclass, framework state such as FSDP's) is put back
*by reference*; what the phase did inside it stays. Forward/backward hooks registered during the
phase stay registered. A torchmetrics Metric is fully restored (its state, update count and caches are
tensors, lists and numbers); metric state that cannot be restored would be a bug to report.

:class:`TrainerRestorePoint` adds what a Trainer owns (optimizer, schedulers, loss scaler, RNG of this
rank, and, through ``trainer.capture_loop()``, its loop state: counters, published metrics and
accumulators, the sampler position): any tuning phase wraps its work in ``with preserved(trainer): ...``.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.utils.errors import CheckpointError
from phalanx.utils.seed import capture_rng_state, restore_rng_state
from phalanx.utils.tensors import is_metric

if TYPE_CHECKING:
    from phalanx.core.view import TrainerView

# nn.Module's own bookkeeping (parameter/buffer/submodule tables, hooks, the training flag): handled
# explicitly below or deliberately left alone (hooks).
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.device, torch.dtype, torch.Size, enum.Enum)

Restorer = Callable[[], Any]


def _put_back(target: torch.Tensor, saved: torch.Tensor) -> None:
    """Copy ``saved`` into ``target`` (the same object afterwards, wherever it is referenced from)."""
    with torch.inference_mode() if target.is_inference() else torch.no_grad():
        if target.shape == saved.shape and target.dtype == saved.dtype and target.device == saved.device:
            target.copy_(saved)
        else:  # resized or re-typed in place: give it back its old storage (identity kept)
            target.data = saved.clone()


def _restorer(value: Any, memo: dict[int, Restorer]) -> Restorer:
    """A function that puts ``value`` back the way it is now and returns it. ``memo`` (by id) makes a
    container reachable twice (or from itself) one restorer."""
    if isinstance(value, _IMMUTABLE):
        return lambda: value
    known = memo.get(id(value))
    if known is not None:
        return known
    restorer = _make_restorer(value, memo)
    memo[id(value)] = restorer
    return restorer


def _make_restorer(value: Any, memo: dict[int, Restorer]) -> Restorer:
    if isinstance(value, torch.Tensor):
        saved = value.detach().clone()

        def restore_tensor() -> torch.Tensor:
            _put_back(value, saved)
            return value

        return restore_tensor
    # Exact container types only: a subclass (an OrderedDict of framework state, a user class) is
    # someone else's object and is kept by reference.
    if type(value) is list:
        memo[id(value)] = lambda: value  # a list that contains itself
        items = [_restorer(v, memo) for v in value]

        def restore_list() -> list[Any]:
            value[:] = [r() for r in items]
            return value

        return restore_list
    if type(value) is dict:
        memo[id(value)] = lambda: value
        entries = [(k, _restorer(v, memo)) for k, v in value.items()]

        def restore_dict() -> dict[Any, Any]:
            restored = [(k, r()) for k, r in entries]
            value.clear()
            value.update(restored)
            return value

        return restore_dict
    if type(value) is tuple:
        parts = [_restorer(v, memo) for v in value]
        return lambda: tuple(r() for r in parts)
    if type(value) is set and all(isinstance(v, _IMMUTABLE) for v in value):
        members = frozenset(value)

        def restore_set() -> set[Any]:
            value.clear()
            value.update(members)
            return value

        return restore_set
    if isinstance(value, torch.Generator):
        state = value.get_state()

        def restore_generator() -> torch.Generator:
            value.set_state(state)
            return value

        return restore_generator
    if isinstance(value, random.Random):
        rng_state = value.getstate()

        def restore_random() -> random.Random:
            value.setstate(rng_state)
            return value

        return restore_random
    return lambda: value  # by reference (a frozenset, an optimizer, a user object): see the module docstring


class _SubmoduleState:
    def __init__(self, module: nn.Module, memo: dict[int, Restorer]) -> None:
        self.module = module
        self.training = module.training
        self.parameters = dict(module._parameters)
        self.param_values = {k: p.detach().clone() for k, p in self.parameters.items() if p is not None}
        self.grads = {k: None if p.grad is None else p.grad.detach().clone()
                      for k, p in self.parameters.items() if p is not None}
        self.buffers = dict(module._buffers)
        self.buffer_values = {k: b.detach().clone() for k, b in self.buffers.items() if b is not None}
        self.non_persistent = set(module._non_persistent_buffers_set)
        self.children = dict(module._modules)
        self.attributes = {k: _restorer(v, memo) for k, v in vars(module).items() if k not in _MODULE_INTERNALS}

    def restore(self) -> None:
        m = self.module
        m.training = self.training
        m._parameters.clear()
        m._parameters.update(self.parameters)
        m._buffers.clear()
        m._buffers.update(self.buffers)
        m._non_persistent_buffers_set.clear()
        m._non_persistent_buffers_set.update(self.non_persistent)
        m._modules.clear()
        m._modules.update(self.children)
        for tensors, values in ((self.parameters, self.param_values), (self.buffers, self.buffer_values)):
            for k, value in values.items():
                target = tensors[k]
                assert target is not None
                _put_back(target, value)
        for k, grad in self.grads.items():
            p = self.parameters[k]
            assert p is not None
            p.grad = grad
        attrs = vars(m)
        for k in [k for k in attrs if k not in _MODULE_INTERNALS and k not in self.attributes]:
            del attrs[k]  # added by the phase
        for k, restore in self.attributes.items():
            attrs[k] = restore()


class ModuleRestorePoint:
    """Everything ``module`` (and each submodule) holds, copied so :meth:`restore` puts it back."""

    def __init__(self, module: nn.Module) -> None:
        memo: dict[int, Restorer] = {}
        self.states = [_SubmoduleState(m, memo) for m in module.modules()]

    def restore(self) -> None:
        # Parents first: a parent's table decides which children exist; each child restores itself.
        for state in self.states:
            state.restore()


class TrainerRestorePoint:
    """A :class:`ModuleRestorePoint` of the Trainer's module plus everything the Trainer itself owns."""

    def __init__(self, trainer: TrainerView) -> None:
        t = trainer
        self.module = ModuleRestorePoint(t.module)
        self.optimizer = copy.deepcopy(t.optimizer.state_dict()) if t.optimizer is not None else None
        self.schedulers = [copy.deepcopy(c.scheduler.state_dict()) for c in t.lr_scheduler_configs]
        self.precision = copy.deepcopy(t.fabric.strategy.precision.state_dict())
        self.rng = capture_rng_state()
        self.restore_loop = t.capture_loop()  # the loops' own state: the Trainer knows what it holds

    def restore(self, trainer: TrainerView) -> None:
        t = trainer
        self.module.restore()
        if self.optimizer is not None:
            t.optimizer.load_state_dict(self.optimizer)
        for c, state in zip(t.lr_scheduler_configs, self.schedulers):
            c.scheduler.load_state_dict(state)
        t.fabric.strategy.precision.load_state_dict(self.precision)
        restore_rng_state(self.rng)
        self.restore_loop()


@contextlib.contextmanager
def preserved(trainer: TrainerView) -> Iterator[None]:
    """Run a tuning phase; afterwards (also on error) the Trainer and its module are exactly as before."""
    point = TrainerRestorePoint(trainer)
    try:
        yield
    finally:
        point.restore(trainer)


# ---------------------------------------------------------------------- metric state in checkpoints
def metrics_of(module: nn.Module) -> list[tuple[str, Any]]:
    """``(path, metric)`` for every torchmetrics Metric inside ``module`` (MetricCollection members too)."""
    return [(name, m) for name, m in module.named_modules() if is_metric(m)]


def _to_plain(value: Any, host: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu" if host else value.device, copy=True)
    if isinstance(value, list):
        return [_to_plain(v, host) for v in value]
    raise CheckpointError(
        f"A metric state holds a {type(value).__name__}; phalanx checkpoints metric states that are tensors or "
        "lists of tensors (what torchmetrics' add_state allows)."
    )


def metric_states(module: nn.Module, host: bool = True) -> dict[str, Any]:
    """This rank's state of every Metric in ``module``: tensors, lists of tensors and ints only (so the
    checkpoint opens with ``weights_only=True``). Metric state is not part of ``state_dict`` (torchmetrics
    registers it non-persistent), yet a run resumed mid-epoch needs it to end with the same epoch value.
    ``host``: copies on the CPU (a checkpoint); otherwise copies where they are (a snapshot copies device
    tensors itself, without a host wait)."""
    out: dict[str, Any] = {}
    for path, metric in metrics_of(module):
        out[path] = {
            "states": {name: _to_plain(getattr(metric, name), host) for name in metric._defaults},
            "update_count": int(metric._update_count),
        }
    return out


def load_metric_states(module: nn.Module, saved: dict[str, Any] | None) -> None:
    """Put back what :func:`metric_states` stored (on the metric's current device, into the same tensors)."""
    if not saved:
        return
    current = dict(metrics_of(module))
    missing = sorted(set(saved) - set(current))
    if missing:
        raise CheckpointError(
            f"The checkpoint holds the state of metrics {missing}, which this module does not have (it has "
            f"{sorted(current)}). Resume with the module that wrote the checkpoint."
        )
    for path, entry in saved.items():
        metric = current[path]
        for name, value in entry["states"].items():
            now = getattr(metric, name)
            if isinstance(value, list):
                device = now[0].device if isinstance(now, list) and now else metric.device
                restored = [v.to(device) for v in value]
                if isinstance(now, list):
                    now[:] = restored  # the same list object: MetricCollection compute groups share it
                else:
                    setattr(metric, name, restored)
            elif isinstance(now, torch.Tensor) and now.shape == value.shape:
                with torch.no_grad():
                    now.copy_(value)
            else:
                setattr(metric, name, value.to(metric.device))
        metric._update_count = int(entry["update_count"])
        metric._computed = None
        metric._forward_cache = None
