"""The call-order guards: FSDP computes right only when each unit's own forward gathers its parameters.

FSDP2 gathers a unit's parameters in the unit's forward pre-hook and reduces its gradients from
hooks the forward installs. Calling a module whose parameters belong to an enclosing unit, while that
unit's forward is not running, computes on sharded parameters and never reduces the gradients; and the
first unit to run forward becomes FSDP's root for good. torch checks neither. This module keeps, per
set-up model, the bookkeeping to refuse both (which units are running forward, how deep, whether the
root is decided) and installs the hooks that raise, naming the module that was called and what to
make a unit instead. Kept apart from the strategy because it is hook plumbing on the module tree, with
its own state, and :class:`~phalanx.strategies.fsdp.strategy.FSDPStrategy` only asks it questions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from phalanx.checkpoint.dcp import class_name
from phalanx.strategies.fsdp.units import owns_unit_parameters
from phalanx.utils.compat import FSDPModule
from phalanx.utils.errors import MisconfigurationError


def decide_root_now(module: FSDPModule) -> bool:
    """Make ``module`` FSDP's root before any forward: otherwise the first unit to run forward becomes
    the root, and calling ``model.student(x)`` before ``model(x)`` would break the real root for good.
    The hook is private to torch; without it (False) phalanx guards the call order instead."""
    try:
        lazy_init = module._get_fsdp_state()._lazy_init
    except AttributeError:
        return False
    lazy_init()
    return True


@dataclass
class Root:
    """Bookkeeping for one set-up (root) FSDP module."""

    name: str
    param_ids: frozenset[int]
    units: list[FSDPModule]  # the outermost sharded units: the root itself, or a bare container's children
    sync_enabled: bool = True
    ran_forward: bool = False  # some unit of this root ran forward since the last backward
    root_ready: bool = True  # FSDP knows this module is its root (see decide_root_now)
    local_only: bool = False  # last backward ran without reduce-scatter
    optimizers: dict[int, bool] = field(default_factory=dict)


class CallOrder:
    """One strategy's set-up roots (by ``id`` of the module) and the forward depth of each sharded unit."""

    def __init__(self) -> None:
        self.roots: dict[int, Root] = {}
        self.active: dict[int, int] = {}  # unit id -> forward depth

    def install(
        self, root: nn.Module, units: list[FSDPModule], root_ready: bool, on_state_dict: Callable[[], None]
    ) -> Root:
        """Record ``root`` and hook its units and the modules inside them; ``on_state_dict`` runs after
        each ``root.state_dict()``."""
        record = Root(class_name(root), frozenset(id(p) for p in root.parameters()), units, root_ready=root_ready)
        self.roots[id(root)] = record
        unit_classes = sorted({class_name(m) for m in root.modules() if isinstance(m, FSDPModule) and m is not root})
        if not root_ready:
            for outer in units:
                cast(nn.Module, outer).register_forward_pre_hook(lambda *_: setattr(record, "root_ready", True))

        def visit(mod: nn.Module, path: str, unit: nn.Module) -> None:
            if isinstance(mod, FSDPModule):
                unit = mod
                self._track_unit(mod, record)
                if not root_ready and not any(mod is outer for outer in units):
                    self._require_root_first(mod, path, record)
            elif owns_unit_parameters(mod):
                # Every module holding parameters of the enclosing unit, outermost first: the check of the
                # module the user actually called fires before those of the layers inside it.
                self._guard_direct_call(mod, path, unit, unit_classes)
            for name, child in mod.named_children():
                visit(child, f"{path}.{name}" if path else name, unit)

        visit(root, "", root)

        def hint(*_: Any) -> None:  # a plain function: torch tags state-dict hooks with attributes
            on_state_dict()

        root.register_state_dict_post_hook(hint)
        return record

    def _track_unit(self, unit: nn.Module, record: Root) -> None:
        self.active[id(unit)] = 0

        def enter(*_: Any) -> None:
            self.active[id(unit)] += 1
            if torch.is_grad_enabled():
                record.ran_forward = True

        def leave(*_: Any) -> None:
            # Also called when a pre-forward hook raised before enter() ran: never count below zero.
            self.active[id(unit)] = max(0, self.active[id(unit)] - 1)

        unit.register_forward_pre_hook(enter)
        unit.register_forward_hook(leave, always_call=True)

    @staticmethod
    def _require_root_first(unit: nn.Module, path: str, record: Root) -> None:
        def check(*_: Any) -> None:
            if not record.root_ready:
                raise MisconfigurationError(
                    f"{path} ({class_name(unit)}) was called directly before {record.name} ever ran forward. "
                    f"This torch offers phalanx no way to make {record.name} FSDP's root at setup, so FSDP would "
                    f"make {path} the root and {record.name} unusable. Call the set-up model once first (e.g. on "
                    "one batch under torch.no_grad()), then call its submodules directly."
                )

        # In front of FSDP's own pre-forward hook, which would pick the root.
        unit.register_forward_pre_hook(check, prepend=True)

    def _guard_direct_call(self, mod: nn.Module, path: str, unit: nn.Module, unit_classes: list[str]) -> None:
        unit_id = id(unit)
        cls = type(mod).__name__
        policy = ", ".join(sorted({cls, *unit_classes}))

        def check(*_: Any) -> None:
            # Backward recomputation (activation checkpointing) re-runs forwards outside the unit's.
            if self.active.get(unit_id, 1) == 0 and torch._C._current_graph_task_id() == -1:
                raise MisconfigurationError(
                    f"{path or cls} ({cls}) was called directly, but its parameters are sharded as part of the "
                    f"enclosing unit {class_name(unit)}, whose forward is not running: it would compute on "
                    "sharded parameters and its gradients would never be reduced. Call the set-up model instead, "
                    f"or make {path or cls} its own sharded unit: FSDPStrategy(auto_wrap_policy={{{policy}}}) "
                    f"(the units sharded now, plus {cls}), or fully_shard(module.{path or '<it>'}, mesh=mesh) in "
                    "parallelize_fn."
                )

        mod.register_forward_pre_hook(check)


__all__ = ["CallOrder", "Root", "decide_root_now"]
