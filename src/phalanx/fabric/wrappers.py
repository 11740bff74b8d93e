"""The objects ``fabric.setup`` returns: thin proxies that route calls through the strategy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.checkpoint import Wrapper
from phalanx.precision import Precision

if TYPE_CHECKING:
    from phalanx.strategies.base import Strategy

_MISSING = object()
_OWN_MODULE_ATTRS = frozenset(
    {"_forward_module", "_original_module", "_strategy", "_fwd", "_orig", "_redirects", "_plain_io"}
)


class FabricModule(nn.Module, Wrapper):
    """Wraps a set-up module. ``model(x)`` and custom methods (``model.generate(x)``) run through the
    strategy's forward (DDP's reducer, autocast, input conversion). Attributes and submodules
    (``model.student``) resolve to the original module; gradients computed through them are still
    averaged by the strategy (see :mod:`phalanx.strategies.ddp`)."""

    _fwd: nn.Module
    _orig: nn.Module
    _plain_io: bool
    _redirects: dict[str, Callable[..., Any]]

    def __init__(self, forward_module: nn.Module, original_module: nn.Module, strategy: Strategy) -> None:
        super().__init__()
        self._forward_module = forward_module
        self._original_module = original_module
        # Plain references too: a registered submodule is found through nn.Module.__getattr__, which
        # costs on every step (forward, every custom-method call, every backward).
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "_fwd", forward_module)
        object.__setattr__(self, "_orig", original_module)
        object.__setattr__(self, "_redirects", {})
        # Full precision converts nothing in or out and enters no context: skip those three calls on
        # every forward.
        precision = strategy.precision
        kind = type(precision)
        plain = (kind.convert_input is Precision.convert_input and precision.param_dtype is None
                 and kind.convert_output is Precision.convert_output
                 and kind.forward_context is Precision.forward_context)
        object.__setattr__(self, "_plain_io", plain)

    @property
    def module(self) -> nn.Module:
        """The user's module as it was passed to ``setup`` (now moved/converted/sharded in place)."""
        return self._orig

    @property
    def forward_module(self) -> nn.Module:
        """The module the strategy runs forward through (e.g. the DDP wrapper)."""
        return self._fwd

    def checkpoint_target(self) -> nn.Module:
        """A checkpoint holds the user's module's state (its keys carry no wrapper prefix)."""
        return self._orig

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ is the hook machinery; nothing is ever registered on this wrapper in the
        # usual loop, so go straight to forward (every step, every forward) unless something is.
        if _hooked(self):
            return super().__call__(*args, **kwargs)
        return self._run(self._fwd, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self._fwd, args, kwargs)

    def _run(self, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``target`` as the strategy's forward: inputs converted, inside the precision's context."""
        strategy = self._strategy
        # Strategies call what they are given (their wrapper, or the module itself): any callable.
        if self._plain_io:
            return strategy.module_forward(target, *args, **kwargs)
        precision = strategy.precision
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            out = strategy.module_forward(target, *args, **kwargs)
        return precision.convert_output(out)

    def _redirect_method(self, name: str) -> Callable[..., Any]:
        """Call ``original.<name>`` *as* the forward, so the strategy sees it (DDP arms its reducer)."""
        original = self._orig

        def call(*args: Any, **kwargs: Any) -> Any:
            method = getattr(original, name)
            if self._fwd is original and not _hooked(original) and not _hooked(self):
                # Nothing wraps the module and no hook watches its calls: running the method itself as
                # the strategy's forward is what the forward patch below achieves, minus two calls.
                return self._run(method, args, kwargs)
            instance = original.__dict__
            saved = instance.get("forward", _MISSING)

            def as_forward(*a: Any, **k: Any) -> Any:
                # Put the real forward back first: nested self(...) calls inside the method must reach it.
                if saved is not _MISSING:
                    instance["forward"] = saved
                elif "forward" in instance:
                    del instance["forward"]
                return method(*a, **k)

            instance["forward"] = as_forward
            try:
                if _hooked(self):
                    return self(*args, **kwargs)
                return self.forward(*args, **kwargs)  # nothing registered on the wrapper: skip its __call__
            finally:
                if saved is not _MISSING:
                    instance["forward"] = saved
                elif "forward" in instance:
                    del instance["forward"]

        return call

    def __getattr__(self, name: str) -> Any:
        redirect = self.__dict__["_redirects"].get(name) if "_redirects" in self.__dict__ else None
        if redirect is not None:
            # The fast path for methods called every step (model.training_step): still a bound method of
            # the original? (It can be replaced; the redirect itself looks it up at each call.)
            original = self.__dict__["_orig"]
            attr = getattr(original, name, None)
            if type(attr) is MethodType and attr.__self__ is original:
                return redirect
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        original = self._orig
        attr = getattr(original, name)
        if (
            callable(attr)
            and not isinstance(attr, nn.Module)
            and getattr(attr, "__self__", None) is original
            and name not in _PASSTHROUGH_METHODS
            and not name.startswith("_")
        ):
            redirect = self._redirects[name] = self._redirect_method(name)
            return redirect
        return attr

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            name in _OWN_MODULE_ATTRS
            or name in self.__dict__
            or "_original_module" not in self.__dict__.get("_modules", {})
        ):
            super().__setattr__(name, value)
        else:
            setattr(self._orig, name, value)

    def __getitem__(self, key: Any) -> Any:
        return self._orig[key]  # type: ignore[index]

    def __len__(self) -> int:
        return len(self._orig)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._orig)  # type: ignore[call-overload, no-any-return]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._orig.load_state_dict(state_dict, strict=strict, assign=assign)


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks of its own (then its ``__call__`` must not be skipped)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


# Methods of nn.Module that query or configure the module; they must not be routed through forward.
_PASSTHROUGH_METHODS = frozenset(dir(nn.Module))

_OWN_OPTIMIZER_ATTRS = frozenset({"_optimizer", "_strategy", "_phalanx_module", "step"})


class FabricOptimizer(Wrapper):
    """Wraps a set-up optimizer; ``step()`` goes through the strategy (loss scaling, sync checks).

    It is an instance of the wrapped optimizer's class too, and every attribute read or write is
    forwarded to the wrapped optimizer, so ``param_groups``/``state`` never go stale (even after
    ``load_state_dict``, which replaces them).
    """

    def __init__(self, optimizer: Optimizer, strategy: Strategy, module: nn.Module | None = None) -> None:
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "_phalanx_module", module)
        cls = type(self)
        object.__setattr__(
            self, "__class__", type("Fabric" + type(optimizer).__name__, (cls, type(optimizer)), {})
        )

    @property
    def optimizer(self) -> Optimizer:
        return self.__dict__["_optimizer"]  # type: ignore[no-any-return]

    def checkpoint_target(self) -> Optimizer:
        return self.__dict__["_optimizer"]  # type: ignore[no-any-return]

    def checkpoint_module(self) -> nn.Module | None:
        return self.__dict__["_phalanx_module"]  # type: ignore[no-any-return]

    def step(self, closure: Callable[[], Any] | None = None) -> float | None:
        strategy = self._strategy
        # (Without a closure, every step of the usual loop, no keyword dict is built and unpacked.)
        loss: float | None = strategy.optimizer_step(self._optimizer) if closure is None else \
            strategy.optimizer_step(self._optimizer, closure=closure)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._strategy.optimizer_zero_grad(self._optimizer, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN_OPTIMIZER_ATTRS:
            object.__setattr__(self, name, value)
        else:
            setattr(self._optimizer, name, value)

    def __repr__(self) -> str:
        return f"FabricOptimizer({self._optimizer!r})"


def param_owner(optimizer: Optimizer, modules: list[FabricModule]) -> FabricModule | None:
    """The set-up module whose parameters the optimizer updates (None if unclear)."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    owners = [m for m in modules if ids & {id(p) for p in m.module.parameters()}]
    return owners[0] if len(owners) == 1 else None


def foreign_parameters(optimizer: Optimizer, modules: list[nn.Module]) -> list[torch.Tensor]:
    """The tensors ``optimizer`` updates that are parameters of none of ``modules``."""
    owned = {id(p) for m in modules for p in m.parameters()}
    return [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]


def is_wrapped(obj: Any) -> bool:
    return isinstance(obj, (FabricModule, FabricOptimizer))


def unwrap_tensor(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
