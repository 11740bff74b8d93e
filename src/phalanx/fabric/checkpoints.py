"""``fabric.save`` / ``load`` / ``load_raw`` / ``remove_checkpoint``: mixed into :class:`phalanx.Fabric`.

Thin on purpose: what a checkpoint holds, how it is written atomically and read without running code
is the checkpoint layer's (:mod:`phalanx.checkpoint`), reached through the strategy, which decides who
writes what (rank 0 a full file, every rank its shards). Here only the user-facing arguments are
checked, with what to write instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.checkpoint.async_sharded import AsyncCheckpoint
    from phalanx.fabric.snapshots import Snapshots
    from phalanx.strategies import Strategy


class CheckpointMethods:
    """The checkpoint calls of a Fabric; every rank calls them (the strategy decides who writes)."""

    _strategy: Strategy

    if TYPE_CHECKING:
        def _ensure_launched(self) -> None: ...

    def save(self, path: str | Path, state: dict[str, Any], filter: Any = None) -> AsyncCheckpoint | None:
        """Save ``state`` (modules, optimizers, stateful objects and plain values). Call it on every rank:
        the strategy decides who writes. The write is atomic. Returns None, or the handle of a save that
        continues in the background (``FSDPStrategy(async_save=True)``, ``ModelParallelStrategy`` too)."""
        self._ensure_launched()
        if filter is not None:
            raise MisconfigurationError(
                "fabric.save(filter=...) is not supported: a checkpoint holds whole state dicts, so that it can "
                "always be loaded back strictly. Save a dict of the entries you want instead (e.g. "
                "{'adapter': {k: v for k, v in model.state_dict().items() if 'lora' in k}})."
            )
        if not isinstance(state, Mapping):
            raise MisconfigurationError(f"fabric.save expects a dict of state, got {type(state).__name__}.")
        return self._strategy.save_checkpoint(path, dict(state))

    _snapshots: Snapshots

    if TYPE_CHECKING:
        def _said_where_resumed(self, path: str | Path, state: dict[str, Any]) -> None: ...

    def load(
        self, path: str | Path, state: dict[str, Any] | None = None, strict: bool = True, *,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from ``path``; returns the checkpoint entries ``state`` did not ask
        for (or the whole checkpoint when ``state`` is None). Call it on every rank. ``strict=False``
        loads what matches and warns what it skipped. ``weights_only`` (None means True): open only
        tensors and plain values; pass False for a trusted file holding other objects (unpickling
        those can run code). Loading what ``latest_checkpoint`` found says where the run resumed (rank 0)."""
        self._ensure_launched()
        self._snapshots.settle()  # a snapshot copied in the background is complete before anything is loaded
        rest = self._strategy.load_checkpoint(path, state, strict, weights_only is not False)
        self._said_where_resumed(path, {**rest, **(state or {})})
        return rest

    def load_raw(
        self, path: str | Path, obj: nn.Module | Optimizer, strict: bool = True, *, weights_only: bool | None = None
    ) -> None:
        """Load a plain state dict (e.g. from ``torch.save(model.state_dict())``) into one module/optimizer."""
        self._ensure_launched()
        self._strategy.load_raw_checkpoint(path, obj, strict, weights_only is not False)

    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete a checkpoint written by ``save`` (a file or a sharded directory). Call it on every rank."""
        self._ensure_launched()
        self._strategy.remove_checkpoint(path)
