"""Creating modules without their default initialisation, and materialising meta-device modules.

``fabric.init_module(empty_init=True)`` promises the parameters will be overwritten (a checkpoint is
loaded into them, or the program runs its own initialisation). Running the default initialisation
anyway is not only wasted time: it draws random numbers, so a program that initialises its weights
itself afterwards draws *different* numbers than it would under Lightning, and trains differently
from the first step. :class:`SkipInit` makes the ``torch.nn.init`` functions no-ops while it is active,
so layers keep the uninitialised memory ``torch.empty`` gave them and the random generators are left
untouched (what Lightning's ``empty_init=True`` does on one device and under DDP).

It is a ``TorchFunctionMode``, so it sees the initialisers that torch dispatches through torch-function
handling: ``uniform_``, ``normal_``, ``kaiming_uniform_``, ``constant_``, ``zeros_`` (all that ``Linear``,
``Embedding``, the convolutions and recurrent layers call). The others (``xavier_uniform_``,
``orthogonal_``, ...) run, exactly as under Lightning's mode, so the random stream stays the same as
Lightning's either way.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class SkipInit(TorchFunctionMode):
    """While active, the ``torch.nn.init`` functions it sees return their tensor unchanged (no memory
    written, no random number drawn). ``enabled=False`` makes the block a no-op, so call sites need no branch."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.enabled and getattr(func, "__module__", None) == "torch.nn.init":
            # The initialisers fill their first argument in place and return it.
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def materialize_meta_tensors(module: nn.Module, device: torch.device | str) -> None:
    """Give every submodule that holds meta-device parameters or buffers real storage on ``device`` and
    initialise it with the submodule's own ``reset_parameters()``. A submodule without that method is
    refused: its tensors would otherwise hold uninitialised memory."""
    for sub in module.modules():
        own = itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))
        if not any(t.is_meta for t in own):
            continue
        reset = getattr(sub, "reset_parameters", None)
        if not callable(reset):
            raise TypeError(
                f"{type(sub).__name__} holds tensors on the meta device but defines no reset_parameters(), so they "
                "cannot be materialised with their values. Define reset_parameters() on it (initialising its own "
                "parameters and buffers), or create the module on a real device."
            )
        sub.to_empty(device=device, recurse=False)
        reset()


@contextlib.contextmanager
def skipping_init(context: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    """``context`` (a strategy's init context) with :class:`SkipInit` active inside it."""
    with context, SkipInit():
        yield
