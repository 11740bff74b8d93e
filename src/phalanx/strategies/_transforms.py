"""Activation checkpointing and ``torch.compile`` as strategy options, applied in the one order that works.

The failures this prevents:

* ``torch.compile`` applied to the wrong object: compiling before the strategy wraps or shards means FSDP
  shards the ``OptimizedModule`` wrapper, a tensor-parallel plan no longer finds ``"blocks.0.attn"`` (it
  is now ``"_orig_mod.blocks.0.attn"``), and every checkpoint key gains an ``_orig_mod.`` prefix. So the
  strategy compiles *after* wrapping, in place (``nn.Module.compile``): the module keeps its identity,
  its state-dict keys, and the wrapper's hooks (DDP's reducer, FSDP's all-gathers) are what gets
  compiled. A model the user compiled before ``fabric.setup`` is unwrapped and re-compiled the same
  way, with the user's options (``phalanx.fabric.compiled``).
* Activation checkpointing is applied before the strategy wraps or shards (the order FSDPStrategy
  always used), with ``torch.distributed._composable.checkpoint``: parameter names do not change,
  unlike with ``checkpoint_wrapper``, so checkpoints stay loadable with and without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from phalanx.utils.errors import MisconfigurationError


def check_policy(
    value: Any, arg: str = "activation_checkpointing_policy", hint: str = ""
) -> tuple[type[nn.Module], ...]:
    """A set of ``nn.Module`` classes (or None) -> a tuple, refusing anything else with the fix."""
    if value is None:
        return ()
    if isinstance(value, (set, frozenset, list, tuple)) and all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in value
    ):
        return tuple(value)
    raise MisconfigurationError(f"{arg} must be a set of nn.Module classes (e.g. {{Block}}), got {value!r}.{hint}")


def apply_activation_checkpointing(module: nn.Module, policy: Iterable[type[nn.Module]]) -> int:
    """Checkpoint every submodule whose class is in ``policy``; returns how many there were (a module
    set up beside the main one, e.g. a frozen teacher, may have none)."""
    classes = tuple(policy)
    if not classes:
        return 0
    from torch.distributed._composable.checkpoint_activation import checkpoint

    chosen = [sub for sub in module.modules() if isinstance(sub, classes)]
    for sub in chosen:
        checkpoint(sub)
    return len(chosen)


def check_compile(value: Any) -> dict[str, Any] | None:
    """``compile=`` option: False/None (off), True (torch.compile defaults) or a dict of its kwargs."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return dict(value)
    raise MisconfigurationError(
        f"compile must be True, False or a dict of torch.compile arguments (e.g. {{'mode': 'max-autotune'}}), "
        f"got {value!r}."
    )


def compile_in_place(module: nn.Module, options: dict[str, Any] | None) -> None:
    """``torch.compile`` the module's call in place (keeps identity, hooks and state-dict keys)."""
    if options is None:
        return
    module.compile(**options)

