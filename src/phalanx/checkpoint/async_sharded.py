"""Asynchronous sharded saves: training goes on while the shards are written, and the checkpoint is
still all-or-nothing.

The failures this prevents:

* A checkpoint that mixes steps. Training keeps updating the parameters in place while the write
  runs, so ``save`` first copies this rank's shards into CPU memory (torch's ``async_save``
  staging, on the caller's thread) and only the copy is written in the background.
* A half-written checkpoint taking the place of a good one. The shards go into the same hidden
  ``.<name>.partial-<token>`` directory as a synchronous save, with the marker written up front;
  rank 0 moves it into place (``sharded._publish``) only when torch reports that every rank's
  shards and the ``.metadata`` are on disk. A process killed at any point before leaves the previous
  checkpoint loadable and a partial directory that ``load`` never reads.
* Checkpoint collectives crossing training collectives. The background write plans and finishes
  with collectives; on the training process group they would interleave with the gradient
  collectives of the main thread in a different order on each rank. They run on a process group of
  their own (gloo, created on first use).
* A failure nobody hears about. A write or publish error is kept and raised on every rank at the
  next synchronisation point: the next ``save``, ``load``, ``teardown``, or ``wait()`` on the handle.

At most one asynchronous save is in flight per strategy; the next save waits for the previous one
first (so checkpoints are published in order, and only one staged copy of the state exists).
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from phalanx.checkpoint.io import META_KEY, _fsync_dir, atomic_save
from phalanx.checkpoint.sharded import (
    MARKER,
    _check_keys,
    _clear_stale,
    _meta,
    _partial_dir,
    _publish,
    _publish_status,
    _remove,
    split_state,
)
from phalanx.collectives import to_timedelta
from phalanx.errors import CheckpointError, MisconfigurationError

if TYPE_CHECKING:
    from phalanx.strategies.parallel import ParallelStrategy


class AsyncCheckpoint:
    """The handle ``fabric.save`` returns for an asynchronous save.

    ``done()`` and ``wait()`` concern this rank only and issue no collectives: on rank 0 they report
    the checkpoint published (moved into place), on the other ranks their shards written.
    """

    def __init__(self, path: Path, tmp: Path, future: Future[Any], publishes: bool) -> None:
        self.path = path
        self._tmp = tmp
        self._publishes = publishes
        self._finished = threading.Event()
        self.error: str | None = None
        future.add_done_callback(self._complete)

    def _complete(self, future: Future[Any]) -> None:
        # Runs on torch's checkpoint thread once this rank's part of the write has ended.
        try:
            future.result()
            if self._publishes:
                _fsync_dir(self._tmp)
                _publish(self._tmp, self.path)
        except BaseException as err:  # kept for wait() and finish(): this thread has no caller
            if self._publishes:
                _remove(self._tmp)
            self.error = f"The asynchronous save of {self.path} failed: {type(err).__name__}: {err}"
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until this rank's part is finished; raise ``CheckpointError`` if it failed."""
        if not self._finished.wait(timeout):
            raise CheckpointError(
                f"The asynchronous save of {self.path} is still being written after {timeout} s: wait longer "
                "(wait() without a timeout waits until it is done)."
            )
        if self.error:
            raise CheckpointError(self.error)


def _layout(obj: Any) -> Any:
    """The structure of a state dict with every tensor replaced by its type, shape and dtype."""
    if isinstance(obj, dict):
        return tuple((k, _layout(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(_layout(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return (type(obj).__name__, tuple(obj.shape), obj.dtype)
    return None


class _ReusedStaging:
    """Staging for torch's ``async_save`` that keeps its CPU copy between saves and copies into it.

    With a fresh copy for every save (torch's default) the save call blocked training 1.3-2.5 s instead
    of ~0.2 s in ``bench/checkpoint.py --stall`` (allocating and first touching the memory dominated);
    torch's own reuse needs pinned memory, hence an accelerator. Reuse is safe because a save starts
    only after the previous write finished (``AsyncSaver.finish``). Costs one copy of this rank's
    shards, held until teardown.
    """

    _synchronize_after_execute = False  # staging is done when stage() returns

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self._layout: Any = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(state_dict)
        if self._buffers is None or layout != self._layout:
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._layout = layout
        copied: dict[str, Any] = _copy_state_dict(state_dict, self._buffers)
        return copied

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers = None


class AsyncSaver:
    """A strategy's asynchronous saves: the checkpoint process group and the save in flight."""

    def __init__(self) -> None:
        self._group: Any = None
        self._staging = _ReusedStaging()
        self.pending: AsyncCheckpoint | None = None

    def save(self, strategy: ParallelStrategy, path: Path, state: dict[str, Any]) -> AsyncCheckpoint:
        """Stage this rank's shards now, write them in the background; a collective (call on every rank)."""
        try:
            from torch.distributed.checkpoint.state_dict_saver import async_save
        except ImportError as err:  # pragma: no cover - torch < 2.3
            raise MisconfigurationError(
                "async_save=True needs torch >= 2.3 (torch.distributed.checkpoint.async_save); upgrade torch."
            ) from err
        _check_keys(state)
        with strategy.guard.guarded("save (asynchronous sharded checkpoint)"):
            pass  # everyone arrives: a save called on rank 0 alone fails here, named
        self.finish(strategy)
        if self._group is None:
            with strategy.guard.guarded("save: create the checkpoint process group"):
                self._group = dist.new_group(backend="gloo", timeout=to_timedelta(strategy.timeout))
        token = uuid.uuid4().hex[:12] if strategy.is_global_zero else None
        token = strategy.collectives.broadcast_object(token, name="save: agree on the temporary directory")
        tmp = _partial_dir(path, str(token))
        tensors, extras, kinds = split_state(state)
        status = None
        if strategy.is_global_zero:
            # The marker is small and describes the state as of this call: write it now, into the hidden
            # directory, so publishing later is a rename only.
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                _clear_stale(path)
                tmp.mkdir()
                atomic_save({META_KEY: _meta(strategy, "sharded", **kinds), "extras": extras}, tmp / MARKER)
            except Exception as err:
                _remove(tmp)
                status = f"Saving {path} failed on rank 0 before writing shards: {type(err).__name__}: {err}"
        _publish_status(strategy, status, "prepared the checkpoint directory")
        try:
            # Staging (the copy of this rank's shards) happens here, on this thread; the write and the
            # checkpoint's own collectives run on torch's checkpoint thread over self._group.
            future = async_save(tensors, storage_writer=FileSystemWriter(str(tmp)), process_group=self._group,
                                async_stager=self._staging)
        except Exception as err:
            if strategy.is_global_zero:
                _remove(tmp)
            raise CheckpointError(f"Starting the asynchronous save of {path} failed: {err}") from err
        if not isinstance(future, Future):  # torch's response object when staging is itself asynchronous
            future = future.upload_completion
        self.pending = AsyncCheckpoint(path, tmp, future, publishes=strategy.is_global_zero)
        return self.pending

    def close(self) -> None:
        """Release the staging copy (teardown)."""
        self._staging.close()

    def finish(self, strategy: ParallelStrategy) -> None:
        """Wait for the save in flight, then raise on every rank if it failed on any (a collective)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending._finished.wait()
        errors = strategy.collectives.all_gather_object(pending.error, name="save: the asynchronous write finished")
        failed = [(rank, err) for rank, err in enumerate(errors) if err]
        if failed:
            rank, err = failed[0]
            raise CheckpointError(f"{err} (on rank {rank}; the previous checkpoint at {pending.path} is unchanged).")
