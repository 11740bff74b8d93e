"""``model = torch.compile(model)`` before ``fabric.setup(model)``, as Lightning accepts it.

The strategy must see the plain module: wrapping or sharding the ``OptimizedModule`` that
``torch.compile`` returns would compile the wrong thing and prefix every parameter name with
``_orig_mod.`` (checkpoints a plain model cannot load). So setup unwraps it, sets up the original
module, and compiles the strategy's forward module (the DDP wrapper, the sharded root, or the module
itself) in place with the *same* compile settings: the compiled wrapper's own dynamo context is
applied to the forward module's call, exactly what ``nn.Module.compile(**same options)`` would do.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from phalanx.strategies import Strategy
from phalanx.utils.errors import MisconfigurationError

Recompile = Callable[[nn.Module], None]


def _optimized_module_type() -> type | None:
    # Only a process that ran torch.compile has imported dynamo; importing it here would cost seconds.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    found = getattr(eval_frame, "OptimizedModule", None)
    return found if isinstance(found, type) else None


def _strategy_compiles(strategy: Strategy) -> bool:
    """Whether the strategy has a ``compile=`` option, i.e. compiles its forward module in place."""
    try:
        return "compile" in inspect.signature(type(strategy)).parameters
    except (TypeError, ValueError):
        return False


def unwrap_compiled(module: nn.Module, strategy: Strategy) -> tuple[nn.Module, Recompile | None]:
    """``(original module, recompile)`` for a ``torch.compile``d module, ``(module, None)`` for any other.
    ``recompile(forward_module)`` compiles the set-up forward module in place with the same settings."""
    optimized = _optimized_module_type()
    if optimized is None or not isinstance(module, optimized):
        return module, None
    original: Any = getattr(module, "_orig_mod", None)
    context: Any = getattr(module, "dynamo_ctx", None)
    if not isinstance(original, nn.Module) or not callable(context):
        raise MisconfigurationError(
            "fabric.setup received a torch.compile'd module whose compile settings this torch version does not "
            "expose. Pass the plain module and compile through the strategy instead: "
            "Fabric(strategy=DDPStrategy(compile={...torch.compile kwargs...})) (or SingleDeviceStrategy, "
            "FSDPStrategy)."
        )
    name = type(strategy).__name__
    if not _strategy_compiles(strategy):
        raise MisconfigurationError(
            f"fabric.setup received a torch.compile'd module, but {name} cannot compile the module it sets up (its "
            "engine owns the forward). Pass the plain module: write `model = fabric.setup(model)` without "
            "`model = torch.compile(model)` before it."
        )
    if strategy.compile_options is not None:
        raise MisconfigurationError(
            f"The module was compiled twice: torch.compile(model) before fabric.setup, and {name}(compile=...). Keep "
            "one: drop torch.compile(model), or the strategy's compile= option."
        )

    def recompile(forward_module: nn.Module) -> None:
        forward_module._compiled_call_impl = context(forward_module._call_impl)

    return original, recompile
