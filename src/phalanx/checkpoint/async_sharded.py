"""Asynchronous sharded saves: training goes on while the shards are written, and the checkpoint is
still all-or-nothing. Everything but the background write is the synchronous directory save's
(:mod:`phalanx.checkpoint.layer`): the same state sorting, marker, plain-values check, hidden
``.partial-`` directory, atomic publish and failure reporting, and DCP's shard layout
(:mod:`phalanx.checkpoint.dcp`), so both write the same checkpoint and ``load`` reads either.

The failures this prevents:

* A checkpoint that mixes steps. Training updates the parameters in place while the write runs, so
  ``save`` first copies this rank's shards into CPU memory, on the caller's thread, and only the
  copy is written in the background. The marker (metadata and the non-tensor entries) is written
  during the call too, so it holds the state as of the call.
* A half-written checkpoint taking the place of a good one. Rank 0 moves the hidden directory into
  place only when torch reports every rank's shards and the ``.metadata`` written. A process killed
  at any moment before leaves the previous checkpoint loadable and a partial directory that
  ``load`` never reads.
* Checkpoint collectives crossing training collectives. The background write plans and finishes
  with collectives; on the training process group they would interleave with the main thread's
  in a different order on each rank. They run on a process group of their own.
* A failure nobody hears about. A write or publish error is kept, with the operating system's cause
  (``storage.write_error``), and raised on every rank at the next save, load, remove or teardown
  (``wait()`` on the handle raises it on this rank at once).

At most one asynchronous save is in flight per strategy: the next one waits for it first, so
checkpoints are published in order and one staged copy of the shards exists.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import async_save

import phalanx.checkpoint.checksums as checksums
import phalanx.checkpoint.storage as storage
from phalanx.checkpoint.dcp import CollectiveScope, DCPShards, plain_failure
from phalanx.checkpoint.format import MARKER, META_KEY, read_file
from phalanx.checkpoint.layer import begin_directory, write_marker
from phalanx.checkpoint.protocol import StateOwner
from phalanx.checkpoint.replace import publish_directory
from phalanx.checkpoint.state import sort_state
from phalanx.distributed.outcome import run_together
from phalanx.utils.errors import CheckpointError, MisconfigurationError


class AsyncCheckpoint:
    """The handle ``fabric.save`` returns for an asynchronous save.

    ``done()`` and ``wait()`` concern this rank only and issue no collectives: on rank 0 they report
    the checkpoint published (moved to ``path``), on the other ranks their shards written.
    """

    def __init__(self, path: Path, tmp: Path, future: Future[Any], publishes: bool) -> None:
        self.path = path
        self._tmp = tmp
        self._publishes = publishes
        self._finished = threading.Event()
        #: Why this rank's part failed (None while running or when it succeeded).
        self.error: CheckpointError | None = None
        future.add_done_callback(self._complete)

    def _complete(self, future: Future[Any]) -> None:
        # On torch's checkpoint thread, once this rank's part of the write has ended.
        try:
            try:
                future.result()
            except CheckpointException as err:  # a BaseException listing every rank's traceback
                plain = plain_failure(err)
                plain.__cause__ = err  # where write_error finds the operating system's cause
                raise storage.write_error(plain, self.path, "write the shards of checkpoint") from err
            except Exception as err:
                raise storage.write_error(err, self.path, "write the shards of checkpoint") from err
            if self._publishes:
                _add_shard_checksums(self._tmp)
                publish_directory(self._tmp, self.path)
        except BaseException as err:  # kept for wait() and finish(): this thread has no caller
            if self._publishes:
                storage.delete_now(self._tmp)
            self.error = err if isinstance(err, CheckpointError) else storage.write_error(
                err, self.path, "publish checkpoint")
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait_finished(self) -> None:
        """Block until this rank's part has ended, successful or not (:meth:`wait` then raises a failure)."""
        self._finished.wait()

    def wait(self, timeout: float | None = None) -> None:
        """Block until this rank's part is finished; raise ``CheckpointError`` if it failed."""
        if not self._finished.wait(timeout):
            raise CheckpointError(
                f"The asynchronous save of {self.path} is still being written after {timeout} s: wait longer "
                "(wait() without a timeout waits until it is done)."
            )
        if self.error is not None:
            raise self.error


def _add_shard_checksums(tmp: Path) -> None:
    """The marker is written when the save is called, the shards later: their checksums join it once
    every rank's shards and the metadata are on disk (rank 0, before publishing)."""
    marker = read_file(tmp / MARKER, what="Checkpoint marker")
    marker[META_KEY]["checksums"].update(checksums.of_files(tmp, skip=[MARKER]))
    storage.write_file(marker, tmp / MARKER, "checkpoint marker")


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
    """This rank's shards copied into CPU memory that is kept from one save to the next.

    With a fresh copy for every save (torch's default) the save call blocks training while the memory is
    allocated and first touched, several times longer than the copy itself (``bench/checkpoint.py --stall``);
    torch's own reuse needs pinned memory, hence an accelerator. Reuse is safe because a save starts
    only after the previous write finished. Costs one copy of this rank's shards, held until teardown.
    """

    def __init__(self) -> None:
        self._copy: dict[str, Any] | None = None
        self._layout: Any = None

    def stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        try:
            from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
        except ImportError:  # torch moved its private helpers: its public stager, a fresh copy every save
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            fresh: dict[str, Any] = BlockingAsyncStager().stage(tensors)
            return fresh
        layout = _layout(tensors)
        if self._copy is None or layout != self._layout:
            self._copy = _create_cpu_state_dict(tensors, pin_memory=torch.cuda.is_available())
            self._layout = layout
        copied: dict[str, Any] = _copy_state_dict(tensors, self._copy)
        return copied

    def close(self) -> None:
        self._copy = None


class _Staged(FileSystemWriter):
    """DCP's file writer, told that the state dict it gets is already a copy (``_ReusedStaging``):
    torch's ``async_save`` stages through its writer, which would copy everything a second time."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict


class AsyncSaves:
    """One strategy's asynchronous saves: their process group, the staging copy, the save in flight.

    Args:
        scope: the strategy's context for waiting on work that needs every rank (its guard's
            ``unguarded``): while a rank waits for the background write, the watchdog watches its peers.
        new_group: creates the process group of the background writes (a collective; called on
            every rank at the first asynchronous save).
    """

    def __init__(self, scope: CollectiveScope, new_group: Callable[[], Any]) -> None:
        self._scope = scope
        self._new_group = new_group
        self._group: Any = None
        self._staging = _ReusedStaging()
        self.pending: AsyncCheckpoint | None = None

    def save(self, owner: StateOwner, path: str | Path, state: dict[str, Any]) -> AsyncCheckpoint:
        """Write ``state`` like ``layer.save``, the shards in the background; a collective."""
        path = Path(path)
        entries = sort_state(state)
        owner.barrier("save")  # enter together: a save reached by some ranks only fails here, named
        self.finish(owner)
        shards = owner.checkpoint_shards()
        if not isinstance(shards, DCPShards):
            raise MisconfigurationError(
                f"Asynchronous saves write sharded torch.distributed.checkpoint directories; strategy {owner.name!r} "
                "is not set up to save sharded checkpoints. Use its sharded state_dict_type or async_save=False."
            )
        if self._group is None:
            self._group = self._new_group()
        tensors, info = shards.state_dicts(entries)
        tmp = begin_directory(owner, path)
        try:
            write_marker(owner, tmp, path, shards.layout, entries, info, publish=False)
            staged = run_together(owner, "save: every rank copied its shards to memory", f"Saving {path}",
                               lambda: self._staging.stage(tensors), CheckpointError)
            # From here the write and its collectives run on torch's checkpoint thread, over self._group.
            started = async_save(staged, storage_writer=_Staged(str(tmp)), process_group=self._group)
        except BaseException:
            if owner.is_global_zero:
                storage.delete_now(tmp)
            raise
        future = started if isinstance(started, Future) else started.upload_completion
        self.pending = AsyncCheckpoint(path, tmp, future, publishes=owner.is_global_zero)
        return self.pending

    def finish(self, owner: StateOwner) -> None:
        """Wait for the save in flight; if it failed on any rank, raise on every rank (a collective)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return

        def wait() -> None:
            with self._scope("save: waiting for the asynchronous checkpoint write"):
                pending.wait_finished()
            pending.wait()

        run_together(owner, "save: the asynchronous write finished", f"The asynchronous save of {pending.path}", wait,
                     CheckpointError)

    def close(self) -> None:
        """Teardown, on this rank alone: wait for a write still running (its process group must not be
        destroyed under it) and free the staging copy."""
        if self.pending is not None:
            self.pending.wait_finished()
            self.pending = None
        self._staging.close()


__all__ = ["AsyncCheckpoint", "AsyncSaves"]
