"""Fabric's per-step snapshots (``fabric.save_snapshot``), folder by folder: when one is due (the folder's
:class:`~phalanx.checkpoint.snapshot.Cadence`), writing it (this rank's shared-memory slots), and what
happens to the folder at the end of the job. The Trainer's ``callbacks.Snapshot`` takes the same path.

Each rank copies its own part (a shard stays a shard) into shared memory: no collective, no pickling of
tensors. With ``overlap`` the parameters and optimizer state are copied while the next forward and backward
run (on a GPU: by the copy engine straight into the slot, the next optimizer step waiting on the device), and each
optimizer waits for the copy before it steps."""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from phalanx.checkpoint import snapshot
from phalanx.checkpoint.snapshot import Cadence, Cost, FolderClaim, RankSnapshots
from phalanx.utils import diagnostics
from phalanx.utils.errors import CheckpointError, MisconfigurationError
from phalanx.utils.late_reads import LateRead

if TYPE_CHECKING:
    from phalanx.strategies import Strategy

_T = TypeVar("_T")


@dataclass(eq=False)
class _Folder:
    cadence: Cadence
    writer: RankSnapshots | None = None  # this rank's shared-memory slots
    off: bool = False  # a write failed on this rank: no more writes (the cadence and its agreement go on)
    prepared: bool = False  # the slots' setup was started ("auto")


class Snapshots:
    """The snapshot folders of one Fabric. A folder given as None is :attr:`default_dir`; a relative one is
    taken from the working directory."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._folders: dict[Path, _Folder] = {}

    @property
    def default_dir(self) -> Path:
        """Node-local shared memory, one folder per script and working directory (the same for every attempt
        of the run)."""
        return snapshot.default_dir(Path.cwd(), sys.argv[0] if sys.argv and sys.argv[0] else "python")

    def folder(self, directory: str | Path | None) -> Path:
        if isinstance(directory, Path) and directory.is_absolute():
            return directory  # the per-step case (the Snapshot callback's folder): no path parsing
        return (Path(directory) if directory is not None else self.default_dir).absolute()

    def save(self, directory: str | Path | None, state: dict[str, Any] | Callable[[], dict[str, Any]], step: int,
             keep: int, overlap: bool, every_n_steps: int | str | Cadence, max_overhead: float) -> Path | None:
        folder = self.folder(directory)
        entry = self._folders.get(folder)
        cadence = every_n_steps if isinstance(every_n_steps, Cadence) else None
        if entry is None or (cadence is not None and entry.cadence is not cadence) or (
                cadence is None and not _same(entry.cadence, every_n_steps, max_overhead)):
            cadence = cadence or Cadence(every_n_steps, max_overhead)  # type: ignore[arg-type]
            if entry is None:
                entry = self._folders[folder] = _Folder(cadence)
            entry.cadence = cadence
        writer = self._writer(entry, folder, keep, overlap)
        if writer is not None:
            writer.poll()  # what the copies in flight cost, as far as it is known (never waits)
            if entry.cadence.auto and not entry.prepared:
                entry.prepared = True
                self._guarded(entry, folder, step, lambda: snapshot.prepare(
                    self._strategy, writer, state() if callable(state) else state))
        ready = entry.writer.ready if entry.writer is not None else None
        if not entry.cadence.due(step, self._agree, ready):
            return None
        start = time.perf_counter()
        cost = self._write(entry, folder, state() if callable(state) else state, step)
        if cost is not None:
            cost.call = time.perf_counter() - start
        line = entry.cadence.taken(step, self._agree, cost)
        if line is not None and self._strategy.global_rank == 0:
            diagnostics.notice(f"Snapshots in {folder}: {line}.")
        return snapshot.reference(folder, step) if cost is not None else None

    def _agree(self, proposal: list[int]) -> LateRead:
        return self._strategy.max_across_ranks_late(proposal, "snapshot cadence")

    def _writer(self, entry: _Folder, folder: Path, keep: int, overlap: bool) -> RankSnapshots | None:
        strategy = self._strategy
        if entry.off:
            return None
        if entry.writer is None:
            entry.writer = RankSnapshots(folder, strategy.global_rank, strategy.world_size, keep, overlap)
        entry.writer.overlap = overlap
        return entry.writer

    def _write(self, entry: _Folder, folder: Path, state: dict[str, Any], step: int) -> Cost | None:
        writer = entry.writer
        if writer is None:
            return None
        return self._guarded(entry, folder, step, lambda: snapshot.write(self._strategy, writer, step, state))

    def _guarded(self, entry: _Folder, folder: Path, step: int, act: Callable[[], _T]) -> _T | None:
        """``act`` on this rank's writer; where it fails for want of shared memory (not for a bad state), this
        rank's snapshots are turned off with a message."""
        strategy = self._strategy
        try:
            return act()
        except (CheckpointError, MisconfigurationError):
            raise  # the state cannot be snapshotted, or another run writes this folder: the user's to fix
        except (OSError, RuntimeError) as err:  # no room in shared memory, a mapping refused; not a bad state
            # This rank's earlier snapshots stay: a step counts only where every rank completed it, which the
            # ranks still writing soon overwrite, so a restart resumes from the newest state all ranks share.
            if entry.writer is not None:
                with contextlib.suppress(Exception):
                    entry.writer.close()
            entry.writer, entry.off = None, True
            diagnostics.warn(f"Snapshots in {folder} are off on rank {strategy.global_rank}: writing the one of step "
                             f"{step} failed ({type(err).__name__}: {err}). Restarts resume from the disk checkpoints.",
                             rank=strategy.global_rank)
            return None

    def settle(self) -> None:
        """Every snapshot copy in flight on this rank is complete (an error surfaces at the next snapshot)."""
        for entry in self._folders.values():
            if entry.writer is not None:
                entry.writer.wait(keep_errors=True)

    def remove(self, directory: str | Path | None) -> None:
        """Delete the snapshots in ``directory`` once this rank's last copy is complete: each rank removes its
        own part, the last one the folder (no collective)."""
        folder = self.folder(directory)
        entry = self._folders.pop(folder, None)
        if entry is not None and entry.writer is not None:
            _finish(entry.writer, remove=True)
        elif self._strategy.global_rank == 0:
            claim = FolderClaim.attempt(folder, 0)
            if claim is not None:  # nothing is deleted while another run writes there
                shutil.rmtree(folder, ignore_errors=True)
                claim.release()

    def close(self, directory: str | Path | None) -> None:
        """Complete this rank's last snapshot in ``directory`` and let go of the folder, keeping its snapshots."""
        entry = self._folders.pop(self.folder(directory), None)
        if entry is None:
            return
        if entry.writer is not None:
            _finish(entry.writer, remove=False)

    def end(self, failed: bool) -> None:
        """At the end of the job: snapshots are only for restarting a run that did not finish, so they are
        removed after a success and completed (for the restart) after a failure."""
        for folder in list(self._folders):
            if failed:
                self.close(folder)
            else:
                self.remove(folder)


def _same(cadence: Cadence, every_n_steps: Any, max_overhead: float) -> bool:
    if cadence.auto:
        return every_n_steps == "auto" and cadence.max_overhead == max_overhead
    return bool(every_n_steps == cadence.every_n_steps)


def _finish(writer: RankSnapshots, remove: bool) -> None:
    """Complete this rank's last snapshot copy (and with ``remove`` delete its files). A failure is reported,
    not raised: the job's own outcome matters more than its last snapshot."""
    try:
        if remove:
            writer.remove()
        else:
            writer.close()
    except Exception as err:
        diagnostics.warn(f"The last snapshot in {writer.folder} failed on rank {writer.rank}: {err}", rank=writer.rank)


__all__ = ["Snapshots"]
