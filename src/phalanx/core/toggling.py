"""Which parameters an optimizer step may touch: ``Module.toggle_optimizer``/``untoggle_optimizer``.

With several optimizers (GANs, actor-critic), a backward for one of them must not leave gradients on
the others' parameters. Toggling freezes every parameter that only other optimizers own, remembering
each one's ``requires_grad`` on the module, and untoggling puts them back. The same algorithm serves a
Module in a Fabric loop (the optimizers ``fabric.setup`` gave it) and under a Trainer (its optimizers,
reached through ``TrainerView.toggle_optimizer``), so it lives here, below both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from phalanx.fabric.wrappers import FabricOptimizer


class Toggleable(Protocol):
    """A module that remembers the ``requires_grad`` flags toggling changed (``phalanx.Module`` does)."""

    toggled_requires_grad: dict[int, tuple[torch.nn.Parameter, bool]]


def unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a set-up (Fabric) optimizer, or ``optimizer`` itself."""
    raw: torch.optim.Optimizer = optimizer.optimizer if isinstance(optimizer, FabricOptimizer) else optimizer
    return raw


def toggle_params(module: Toggleable, mine: torch.optim.Optimizer, everything: Iterable[torch.optim.Optimizer]) -> None:
    """Freeze every parameter of the other optimizers in ``everything`` (remembering requires_grad on
    ``module``) so only ``mine``'s parameters get gradients. (Plain torch optimizers: the runner unwraps.)"""
    own = {id(p) for g in mine.param_groups for p in g["params"]}
    saved = module.toggled_requires_grad
    for opt in everything:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in own:
                    continue
                saved.setdefault(id(p), (p, p.requires_grad))
                p.requires_grad = False


def untoggle_params(module: Toggleable) -> None:
    """Undo :func:`toggle_params`: every parameter it froze gets its requires_grad back."""
    for p, requires_grad in module.toggled_requires_grad.values():
        p.requires_grad = requires_grad
    module.toggled_requires_grad.clear()
