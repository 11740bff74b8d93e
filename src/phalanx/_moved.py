"""Module paths from before the layered layout (docs/architecture.md), kept importable.

``import phalanx.launch`` (or ``from phalanx.collectives import Lockstep``, or a pickle naming an old
path) gets the module at its new home: the same module object, so patching one patches the other.
Nothing inside phalanx uses these names; they exist for users' code and for old pickles. One table and
one finder instead of a shim file per old path, so the tree shows only the layers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

MOVED = {
    "phalanx.diagnostics": "phalanx.utils.diagnostics",
    "phalanx._compat": "phalanx.utils.compat",
    "phalanx.seed": "phalanx.utils.seed",
    "phalanx.launch": "phalanx.distributed.launch",
    "phalanx.accelerator": "phalanx.distributed.accelerator",
    "phalanx.collectives": "phalanx.distributed.lockstep",
    "phalanx.watchdog": "phalanx.distributed.watchdog",
    "phalanx.anomaly": "phalanx.fabric.anomaly",
    "phalanx.wrappers": "phalanx.fabric.wrappers",
    "phalanx.fabric_collectives": "phalanx.fabric.collectives",
    "phalanx.data": "phalanx.fabric.data",
    "phalanx.module_state": "phalanx.core.module_state",
    "phalanx.trainer.module": "phalanx.core.module",
    "phalanx.trainer.hparams": "phalanx.core.hparams",
    "phalanx.trainer.loading": "phalanx.core.loading",
    "phalanx.batch_size_scaling": "phalanx.tuner.batch_size",
    "phalanx.callbacks.lr_finder": "phalanx.tuner.lr_finder_callback",
    "phalanx.callbacks.batch_size_finder": "phalanx.tuner.batch_size_callback",
    "phalanx.cli_config": "phalanx.cli.config",
    "phalanx.checkpoint.cli": "phalanx.cli.checkpoint",
    "phalanx.strategies.deepspeed_checkpoint": "phalanx.strategies.deepspeed.checkpoint",
    "phalanx.strategies.deepspeed_config": "phalanx.strategies.deepspeed.config",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the names in :data:`MOVED` to the modules they moved to."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the old name's spec on the real module; give it its own back so
        # the module still knows where it lives (reload, pickling by module path, debuggers).
        if module.__spec__ is not None and module.__spec__.loader_state is not None:
            module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Add the finder once per interpreter (importing phalanx twice must not add it twice)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
