"""``LambdaCallback``: a callback built from functions, one per hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.callbacks.base import Callback
from phalanx.utils.errors import MisconfigurationError


class LambdaCallback(Callback):
    """A callback from functions: ``LambdaCallback(on_train_epoch_end=lambda trainer, module: ...)``. A name
    that is not a callback hook is refused (it would never be called)."""

    def __init__(self, **hooks: Callable[..., Any] | None) -> None:
        for name, fn in hooks.items():
            if not name.startswith(("on_", "setup", "teardown")) or not hasattr(Callback, name):
                raise MisconfigurationError(f"LambdaCallback got {name!r}, which is not a callback hook.")
            if fn is not None:
                setattr(self, name, fn)
