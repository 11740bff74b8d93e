"""FSDP's side of checkpoints: its state is DTensor shards, so every state-dict call is a collective.

The checkpoint layer (:mod:`phalanx.checkpoint`) asks a strategy for full or sharded state and hands
it back on load (:class:`~phalanx.checkpoint.protocol.StateOwner`). For FSDP each answer gathers or scatters
shards (:mod:`phalanx.checkpoint.dcp`), runs under the lockstep guard, may overlap an asynchronous
save still being written (which must be finished first), and must not trigger the hint about
``torch.save(model.state_dict())`` meant for users. That is one concern with its own state (the
asynchronous saves, the internal-call depth), so it is a base class of
:class:`~phalanx.strategies.fsdp.strategy.ShardedStrategy` (and so of FSDPStrategy and ModelParallelStrategy)
of its own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from phalanx.checkpoint import dcp
from phalanx.checkpoint.async_sharded import AsyncCheckpoint, AsyncSaves
from phalanx.checkpoint.dcp import class_name
from phalanx.checkpoint.protocol import Shapes, ShardIO
from phalanx.distributed.lockstep import to_timedelta
from phalanx.strategies.parallel import ParallelStrategy
from phalanx.utils.errors import MisconfigurationError

STATE_DICT_TYPES = ("sharded", "full")
_DCP_DIR = os.path.join("torch", "distributed", "checkpoint")


def _called_from_dcp() -> bool:
    """Whether torch.distributed.checkpoint's helpers asked for the state dict (they handle shards)."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if _DCP_DIR in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class FSDPCheckpointing(ParallelStrategy):
    """Checkpoint I/O of a strategy whose parameters and optimizer state are DTensor shards.

    Args:
        state_dict_type: ``"sharded"`` (a directory, every rank writes its shards) or ``"full"`` (one
            file gathered to rank 0). ``load`` reads either.
        async_save: ``fabric.save`` copies this rank's shards into memory, writes them in the background
            and returns an :class:`~phalanx.checkpoint.async_sharded.AsyncCheckpoint` at once; the
            checkpoint is published when every rank has written (sharded checkpoints only).
        Other arguments: see :class:`~phalanx.strategies.parallel.ParallelStrategy`.
    """

    #: A single-file load is read by rank 0 alone; each tensor is broadcast and every rank keeps its shard.
    loads_full_state_on_rank0: ClassVar[bool] = True

    def __init__(self, *, state_dict_type: str = "sharded", async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if state_dict_type not in STATE_DICT_TYPES:
            raise MisconfigurationError(f"state_dict_type={state_dict_type!r}; choose one of {STATE_DICT_TYPES}.")
        if async_save and state_dict_type != "sharded":
            raise MisconfigurationError(
                f"async_save=True writes sharded checkpoints; it cannot be combined with state_dict_type="
                f"{state_dict_type!r}. Drop one of the two (`phalanx consolidate` turns a sharded checkpoint into "
                "one file)."
            )
        self.state_dict_type = state_dict_type
        self.async_save = async_save
        self._saves = AsyncSaves(self.unguarded, self._new_checkpoint_group)
        self._internal_state_dict = 0
        self._warned_state_dict = False

    # ------------------------------------------------------------------ the user's state_dict() calls
    def _state_dict_hint(self) -> None:
        if self._internal_state_dict or self._warned_state_dict or _called_from_dcp():
            return
        self._warned_state_dict = True
        warnings.warn(
            "Under FSDP, model.state_dict() holds only this rank's shards (DTensors): torch.save of it on "
            "rank 0 alone stores rank 0's shards only. Use fabric.save(path, {'model': model, ...}) on every "
            "rank (state_dict_type='full' gives one plain file).",
            UserWarning,
            stacklevel=4,
        )

    @contextlib.contextmanager
    def internal_state_dict(self) -> Iterator[None]:
        """phalanx's own state-dict calls: no hint about torch.save."""
        self._internal_state_dict += 1
        try:
            yield
        finally:
            self._internal_state_dict -= 1

    # ------------------------------------------------------------------ state dicts
    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full (unsharded) state dict, on every rank. A collective: call it on every rank."""
        with self.internal_state_dict(), self.guard.unguarded("module_state_dict (FSDP all-gather)"):
            return dcp.full_model_state(module, rank0_only=False)

    def load_module_state_dict(self, module: nn.Module, state: dict[str, Any], strict: bool) -> None:
        self.scatter_module_state(module, state, strict, from_rank0=False)

    def optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer) -> dict[str, Any]:
        with self.internal_state_dict(), self.guard.unguarded("optimizer_state_dict (FSDP all-gather)"):
            return dcp.full_optimizer_state(module, optimizer, rank0_only=False)

    def load_optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer, state: dict[str, Any]) -> None:
        self.scatter_optimizer_state(module, optimizer, state, from_rank0=False)

    def local_state(self, kind: str, obj: Any, module: nn.Module | None) -> dict[str, Any]:
        """This rank's shards (DTensors), no all-gather: what a per-step snapshot copies."""
        with self.internal_state_dict():
            return obj.state_dict()  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ the checkpoint layer's view
    def checkpoint_shards(self, layout: str | None = None) -> ShardIO | None:
        if layout is None and self.state_dict_type == "full":
            return None
        if layout not in (None, dcp.DCPShards.layout):
            return None
        return dcp.DCPShards(self.guard.unguarded)

    def gather_module_state(self, module: nn.Module) -> dict[str, Any]:
        with self.internal_state_dict(), self.guard.unguarded("save: gathering the full model on rank 0"):
            return dcp.full_model_state(module, rank0_only=True)

    def gather_optimizer_state(self, module: nn.Module | None, optimizer: Optimizer) -> dict[str, Any]:
        with self.internal_state_dict(), self.guard.unguarded("save: gathering the full optimizer state on rank 0"):
            return dcp.full_optimizer_state(module, optimizer, rank0_only=True)

    def scatter_module_state(self, module: nn.Module, state: dict[str, Any], strict: bool, from_rank0: bool) -> None:
        with self.internal_state_dict(), self.guard.unguarded("load: sharding the full model"):
            dcp.load_full_model_state(module, state, strict, broadcast=from_rank0)

    def scatter_optimizer_state(
        self, module: nn.Module | None, optimizer: Optimizer, state: dict[str, Any], from_rank0: bool
    ) -> None:
        with self.internal_state_dict(), self.guard.unguarded("load: sharding the full optimizer state"):
            dcp.load_full_optimizer_state(module, optimizer, state, broadcast=from_rank0)

    def module_layout(self, module: nn.Module) -> tuple[str, Shapes]:
        with self.internal_state_dict():  # DTensor shapes are the full shapes: no gather needed
            return class_name(module), super().module_layout(module)[1]

    # ------------------------------------------------------------------ saves, loads, asynchronous writes
    def save_checkpoint(self, path: str | Path, state: dict[str, Any]) -> AsyncCheckpoint | None:
        with self.internal_state_dict():
            if self.async_save:
                return self._saves.save(self, path, state)
            self._saves.finish(self)  # async_save was switched off while a write ran
            super().save_checkpoint(path, state)
        return None

    # A save still being written must be published (or have failed, on every rank) before anything
    # reads or removes checkpoints: the next save waits for it too (AsyncSaves.save).
    def load_checkpoint(
        self, path: str | Path, state: dict[str, Any] | None, strict: bool, weights_only: bool = True
    ) -> dict[str, Any]:
        self._saves.finish(self)
        with self.internal_state_dict():
            return super().load_checkpoint(path, state, strict, weights_only)

    def load_raw_checkpoint(self, path: str | Path, obj: Any, strict: bool, weights_only: bool = True) -> None:
        self._saves.finish(self)
        super().load_raw_checkpoint(path, obj, strict, weights_only)

    def remove_checkpoint(self, path: str | Path) -> None:
        self._saves.finish(self)
        super().remove_checkpoint(path)

    def _new_checkpoint_group(self) -> Any:
        # The background write's collectives must not interleave with training's on the default group
        # (they would, in a different order on each rank); gloo, because the staged shards are on the CPU.
        with self.guard.guarded("save: create the process group of asynchronous checkpoints"):
            return dist.new_group(backend="gloo", timeout=to_timedelta(self.timeout))

    def teardown(self, error: BaseException | None = None) -> None:
        ending = error
        try:
            if error is None and self._guard is not None:
                self._saves.finish(self)  # a failed background write is raised here, on every rank
        except BaseException as err:
            ending = err
            raise
        finally:
            self._saves.close()  # never destroy the process groups under a write still running
            super().teardown(ending)


__all__ = ["STATE_DICT_TYPES", "FSDPCheckpointing"]
