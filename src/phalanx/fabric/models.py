"""The models and optimizers one Fabric set up (``fabric.setup`` / ``setup_module`` / ``setup_optimizers``
/ ``release``): what is checked before the strategy wraps them, and which model an optimizer trains.

Everything the strategy does not sync or shard is refused at setup, with what to write instead: an
optimizer over parameters of no set-up model would let each rank silently train its own copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.fabric.compiled import unwrap_compiled
from phalanx.fabric.wrappers import FabricModule, FabricOptimizer, foreign_parameters, param_owner
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.strategies import Strategy


@dataclass(frozen=True)
class FabricLink:
    """What ``fabric.setup`` tells a module that asks (:class:`FabricLinked`): the Fabric that set it up, which
    a :class:`phalanx.Module` run in a Fabric loop logs and steps through (its ``self.log``,
    ``self.manual_backward``), and the optimizers set up with it (its ``self.optimizers()``)."""

    fabric: Any  # the Fabric (fabric.py imports this module, so it is not named here)
    optimizers: tuple[FabricOptimizer, ...]


@runtime_checkable
class FabricLinked(Protocol):
    """A module that declares ``fabric_link`` (``phalanx.Module`` does, None until set up) is given its
    :class:`FabricLink` by ``fabric.setup``/``setup_module``."""

    fabric_link: FabricLink | None


class Models:
    """The set-up models of one Fabric (:attr:`modules`, in setup order). ``fabric``: the Fabric a module
    that declares ``fabric_link`` is linked to. The caller has joined the job."""

    def __init__(self, strategy: Strategy, fabric: object) -> None:
        self._strategy, self._fabric = strategy, fabric
        self.modules: list[FabricModule] = []

    def setup(self, module: nn.Module, optimizers: tuple[Optimizer, ...],
              move_to_device: bool) -> tuple[FabricModule, list[FabricOptimizer]]:
        _check_new_module(module)
        module, recompile = unwrap_compiled(module, self._strategy)
        self._check_placement(module, move_to_device)
        for opt in optimizers:
            _check_new_optimizer(opt)
            self._check_owned(opt, module)
        forward_module, raw_opts = self._strategy.setup_module_and_optimizers(module, list(optimizers))
        if recompile is not None:
            recompile(forward_module)
        wrapped = FabricModule(forward_module, module, self._strategy)
        self.modules.append(wrapped)
        opts = [FabricOptimizer(opt, self._strategy, module) for opt in raw_opts]
        self._link(module, opts)
        return wrapped, opts

    def setup_module(self, module: nn.Module, move_to_device: bool) -> FabricModule:
        _check_new_module(module)
        module, recompile = unwrap_compiled(module, self._strategy)
        self._check_placement(module, move_to_device)
        forward_module = self._strategy.setup_module(module)
        if recompile is not None:
            recompile(forward_module)
        wrapped = FabricModule(forward_module, module, self._strategy)
        self.modules.append(wrapped)
        self._link(module, [])
        return wrapped

    def setup_optimizer(self, optimizer: Optimizer) -> FabricOptimizer:
        _check_new_optimizer(optimizer)
        found = param_owner(optimizer, self.modules)
        owner = found.module if found is not None else None
        raw = self._strategy.setup_optimizer(optimizer)  # first: a backend may know better why a param is foreign
        self._check_owned(raw)
        return FabricOptimizer(raw, self._strategy, owner)

    def release(self, model: FabricModule) -> None:
        if not any(m is model for m in self.modules):
            raise MisconfigurationError("fabric.release(model): this model was not set up by this Fabric.")
        self.modules = [m for m in self.modules if m is not model]
        self._strategy.release_module(model.forward_module)

    def verify_in_sync(self, module: nn.Module, grads: bool, params: bool, rtol: float) -> None:
        raw = module.module if isinstance(module, FabricModule) else module
        if params:
            self._strategy.verify_in_sync([(n, p) for n, p in raw.named_parameters()], "parameters", rtol)
        if grads:
            named: list[tuple[str, torch.Tensor]] = [
                (n + ".grad", p.grad) for n, p in raw.named_parameters() if p.grad is not None
            ]
            self._strategy.verify_in_sync(named, "gradients", rtol)

    def _check_placement(self, module: nn.Module, move_to_device: bool) -> None:
        """``move_to_device=False``: the module stays where it is. Every strategy runs the module on this
        rank's device, so that holds when it is already there (or on the meta device, for the strategy
        to materialize); anywhere else is refused rather than moved behind the caller's back."""
        if move_to_device:
            return
        device = self._strategy.root_device
        elsewhere = {str(t.device) for t in (*module.parameters(), *module.buffers())
                     if t.device.type != "meta" and t.device != device}
        if elsewhere:
            raise MisconfigurationError(
                f"setup(move_to_device=False): the module is on {sorted(elsewhere)} but this rank runs on "
                f"{device}, and the strategy runs the module there. Create it there (`with "
                "fabric.init_module():`) or move it yourself, or pass move_to_device=True."
            )

    def _link(self, module: nn.Module, optimizers: list[FabricOptimizer]) -> None:
        if isinstance(module, FabricLinked):
            module.fabric_link = FabricLink(self._fabric, tuple(optimizers))

    def _check_owned(self, optimizer: Optimizer, module: nn.Module | None = None) -> None:
        """Refuse parameters of no set-up module: nothing would sync (DDP) or shard (FSDP) them, so each
        rank would silently train its own copy."""
        foreign = foreign_parameters(optimizer, [m.module for m in self.modules] + ([module] if module else []))
        if foreign:
            n = len(foreign)
            what = f"{type(module).__name__} (nor of a model set up before)" if module is not None else (
                "any model set up with this Fabric")
            raise MisconfigurationError(
                f"{type(optimizer).__name__} updates {n} parameter{'s' if n != 1 else ''} that "
                f"{'are' if n != 1 else 'is'} not part of {what}: phalanx would neither average their gradients "
                "across ranks nor shard them, so each rank would train its own copy. Set up every model the "
                "optimizer trains: put them in one nn.Module (e.g. nn.ModuleDict({'a': a, 'b': b})) and set that "
                "up, or `b = fabric.setup_module(b)` first; then create the optimizer from the set-up models' "
                "parameters (`torch.optim.X(model.parameters())`)."
            )


def _check_new_module(module: Any) -> None:
    if isinstance(module, FabricModule):
        raise MisconfigurationError("This module was already set up by fabric.setup(); set it up once.")
    if not isinstance(module, nn.Module):
        raise MisconfigurationError(f"fabric.setup expects an nn.Module, got {type(module).__name__}.")


def _check_new_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, FabricOptimizer):
        raise MisconfigurationError("This optimizer was already set up; set it up once.")
    if not isinstance(optimizer, Optimizer):
        raise MisconfigurationError(f"Expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")


__all__ = ["Models"]
