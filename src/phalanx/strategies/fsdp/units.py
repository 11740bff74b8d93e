"""Which modules become FSDP's sharded units, and what the model's structure says about them.

The sharding policy's questions, answered from the module tree alone (no process group, no strategy
state): the layers sharded by default, whether a model is a bare container that cannot be a unit
itself, which sharded units are outermost (each becomes its own FSDP root), which modules hold
parameters of an enclosing unit (their direct calls are guarded), and which tied weights must stay in
one unit (the hint when FSDP refuses a split).
"""

from __future__ import annotations

from torch import nn

from phalanx.utils.compat import FSDPModule
from phalanx.utils.errors import MisconfigurationError

# Layers torch ships that are natural sharding units, besides the elements of any nn.ModuleList.
DEFAULT_UNIT_CLASSES: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def is_default_unit(module: nn.Module, in_lists: set[int]) -> bool:
    """The default policy: an element of an ``nn.ModuleList`` (ids in ``in_lists``) or a torch Transformer layer."""
    return id(module) in in_lists or isinstance(module, DEFAULT_UNIT_CLASSES)


def list_elements(module: nn.Module) -> set[int]:
    """Ids of every module that is an element of some ``nn.ModuleList`` under ``module``."""
    return {id(m) for lst in module.modules() if isinstance(lst, nn.ModuleList) for m in lst}


def is_bare_container(module: nn.Module) -> bool:
    """A ModuleDict/ModuleList (or subclass) without its own forward, which fully_shard refuses."""
    if not isinstance(module, (nn.ModuleDict, nn.ModuleList)) or type(module).forward is not nn.Module.forward:
        return False
    own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    if own:
        raise MisconfigurationError(
            f"{type(module).__name__} has no forward, so FSDP cannot make it a sharded unit, and it holds tensors of "
            f"its own ({own}) that no child unit would shard. Move them into a child module, or give the model "
            "a forward (subclass nn.Module)."
        )
    return True


def outermost_units(module: nn.Module) -> list[FSDPModule]:
    """The sharded units not inside another one: the module itself, or a bare container's children."""
    if isinstance(module, FSDPModule):
        return [module]
    return [u for child in module.children() for u in outermost_units(child)]


def owns_unit_parameters(module: nn.Module) -> bool:
    """Whether some parameter under ``module`` is not inside a nested sharded unit."""
    if any(True for _ in module.parameters(recurse=False)):
        return True
    return any(not isinstance(c, FSDPModule) and owns_unit_parameters(c) for c in module.children())


def tied_weights_hint(module: nn.Module) -> str:
    """Name the smallest module that holds every user of each shared (tied) parameter: the class to
    make a unit, instead of one of the modules that share it."""
    users: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        users.setdefault(id(p), []).append(name.rsplit(".", 1)[0] if "." in name else "")
    hints = []
    modules = dict(module.named_modules())
    for paths in users.values():
        if len(set(paths)) < 2:
            continue
        common = paths[0].split(".")
        for path in paths[1:]:
            parts = path.split(".")
            n = 0
            while n < min(len(common), len(parts)) and common[n] == parts[n]:
                n += 1
            common = common[:n]
        holder = ".".join(common)
        cls = type(modules[holder]).__name__ if holder in modules else type(module).__name__
        hints.append(f"{' and '.join(sorted(set(paths)))} share a parameter (tied weights), so they must be in one "
                     f"unit: make {holder or 'the root'} ({cls}) the unit (auto_wrap_policy={{{cls}, ...}}) and "
                     "leave the modules that share it out of auto_wrap_policy")
    if not hints:
        return "Parameters shared between modules (tied weights) must live in one sharded unit."
    return "; ".join(hints[:3]) + "."


__all__ = [
    "DEFAULT_UNIT_CLASSES",
    "is_bare_container",
    "is_default_unit",
    "list_elements",
    "outermost_units",
    "owns_unit_parameters",
    "tied_weights_hint",
]
