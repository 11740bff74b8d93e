"""Fabric's calls for runs that survive: ``stop_requested``, ``exit_preempted``, ``latest_checkpoint``.

A loop that keeps its own control flow stays in charge: ``fabric.stop_requested()`` says, on every rank
at the same call, that a preemption signal arrived somewhere (see :mod:`phalanx.distributed.preemption`);
the loop saves as it always does and ends with ``fabric.exit_preempted(path)``. Under a restarting
launcher (``Fabric(max_restarts=K)``, ``torchrun --max-restarts K``) or a requeued job, the next attempt
finds where to continue with ``fabric.latest_checkpoint(directory)``.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from phalanx import checkpoint
from phalanx.checkpoint import snapshots
from phalanx.checkpoint.rank_snapshot import FolderClaim, RankSnapshots
from phalanx.checkpoint.summary import counters
from phalanx.distributed import restarts
from phalanx.distributed.launch import record_failure, restart_count
from phalanx.distributed.preemption import Preempted, PreemptionSignals, Stop, requeue_slurm_job
from phalanx.utils import diagnostics
from phalanx.utils.errors import CheckpointError, MisconfigurationError

if TYPE_CHECKING:
    from phalanx.strategies import Strategy


class PreemptionMethods:
    """The preemption and restart calls of a Fabric."""

    _strategy: Strategy
    _preemption: PreemptionSignals
    _stop: Stop | None
    #: Per folder: this rank's shared-memory slots, or the checkpoint snapshots written (a list; empty when
    #: shared-memory snapshots were turned off after a failed write).
    _snapshot_folders: dict[Path, RankSnapshots | list[Path]]
    #: Per folder of checkpoint snapshots: this rank's hold on it (RankSnapshots holds its own).
    _snapshot_claims: dict[Path, FolderClaim]
    #: What :meth:`latest_checkpoint` found last: loading it is resuming, and ``fabric.load`` says so.
    _latest: Path | None

    if TYPE_CHECKING:
        def _ensure_launched(self) -> None: ...
        def save(self, path: str | Path, state: dict[str, Any], filter: Any = None) -> Any: ...
        def remove_checkpoint(self, path: str | Path) -> None: ...

    def stop_requested(self) -> bool:
        """True on every rank, at the same call, once any rank received a preemption signal (SIGTERM or
        SIGUSR1 by default: ``Fabric(preemption_signals=...)`` or ``PHALANX_PREEMPTION_SIGNALS``).

        Call it on every rank at the same point of the loop, e.g. after each optimizer step: with more
        than one process it is a collective (one all-reduce of two integers). The first call starts
        listening for the signals; until then they keep their default effect (SIGTERM ends the process),
        so a loop that never asks is not left running after its scheduler asked it to stop. Once True, it
        stays True without communicating again."""
        self._ensure_launched()
        if self._stop is not None:
            return True
        self._preemption.install()
        self._stop = self._preemption.agree(self._strategy.global_rank, self._strategy.world_size,
                                            self._agree_across_ranks)
        return self._stop is not None

    def release_signals(self) -> None:
        """Stop listening: the preemption signals get their previous handlers back (SIGTERM ends the process
        again). The next :meth:`stop_requested` listens anew; an agreed stop stays agreed."""
        self._preemption.uninstall()

    def _agree_across_ranks(self, values: list[int]) -> list[int]:
        return self._strategy.max_across_ranks(values, "stop_requested")

    @property
    def preemption(self) -> Stop | None:
        """The agreed stop (signal and rank) once :meth:`stop_requested` returned True, else None."""
        return self._stop

    def exit_preempted(self, checkpoint_path: str | Path | None = None, step: int | None = None) -> NoReturn:
        """End this rank after a preemption stop: rank 0 prints one line (step, signal, rank, checkpoint,
        how to resume) and, under SLURM, requeues the job; every rank exits with code 75
        (:data:`phalanx.distributed.preemption.EXIT_PREEMPTED`) without a traceback. Call it on every
        rank, after the checkpoint is saved."""
        stop = self._stop
        cause = stop.describe() if stop is not None else "request"
        where = f" at step {step}" if step is not None else ""
        saved = f"checkpoint: {checkpoint_path}" if checkpoint_path is not None else "no checkpoint was written"
        since = self._preemption.received_at
        took = f" ({time.monotonic() - since:.1f} s after the signal)" if since is not None else ""
        message = (f"preempted{where} by {cause}; {saved}{took}. Run the same command again to resume"
                   + (" from it" if checkpoint_path is not None else "") + "." + restarts.logs_named())
        error = Preempted(message)
        record_failure(error)  # what torch's launcher (and phalanx's) quotes for this rank
        if self._strategy.global_rank == 0:
            print(f"[phalanx] {message}", file=sys.stderr, flush=True)
            if stop is not None and checkpoint_path is not None:
                requeue_slurm_job(lambda line: print(f"[phalanx] {line}", file=sys.stderr, flush=True))
        raise error

    def latest_checkpoint(self, directory: str | Path, *more: str | Path) -> Path | None:
        """The newest complete checkpoint in ``directory`` (and the other directories given): a file, or a
        sharded directory whose save finished; None when there is none. Interrupted saves are skipped.
        With more than one process, rank 0 decides and every rank gets its answer (call it on every rank)."""
        dirs = [Path(directory), *map(Path, more)]
        self._settle_snapshots()
        if self._strategy.num_processes > 1:
            self._ensure_launched()
            world = self._strategy.world_size
            found = checkpoint.latest(dirs, world_size=world) if self._strategy.global_rank == 0 else None
            answer = self._strategy.broadcast(str(found) if found is not None else None)
            self._latest = Path(answer) if answer is not None else None
        else:
            self._latest = checkpoint.latest(dirs, world_size=1)
        if self._latest is None:
            restarts.started_over(f"Nothing to resume from in {', '.join(map(str, dirs))}: the loop starts from its "
                                  "beginning", self._strategy.global_rank)
        return self._latest

    def _said_where_resumed(self, path: str | Path, state: dict[str, Any]) -> None:
        """After ``fabric.load(path, ...)``: loading what :meth:`latest_checkpoint` found is resuming, said in one
        line (rank 0) with the step and epoch the loaded state holds (``step``/``global_step``, ``epoch``)."""
        if self._latest is None or Path(path) != self._latest:
            return
        found = counters(state)
        restarts.resumed(path, found.get("step"), found.get("epoch"), self._strategy.global_rank)

    def _said_where_started(self) -> None:
        """At the first ``fabric.backward`` of a restarted attempt that did not resume through
        :meth:`latest_checkpoint`: say so (rank 0), so that a restart is never silent."""
        restarts.started_over("The script runs again from its start: it resumes only from what it loads itself "
                              "(fabric.latest_checkpoint finds the newest checkpoint)", self._strategy.global_rank)

    @property
    def snapshot_dir(self) -> Path:
        """Where :meth:`save_snapshot` writes by default: node-local shared memory, one folder per script and
        working directory (the same for every attempt of the run)."""
        return snapshots.default_dir(Path.cwd(), sys.argv[0] if sys.argv and sys.argv[0] else "python")

    def save_snapshot(self, state: dict[str, Any], step: int, directory: str | Path | None = None,
                      keep: int = 2, overlap: bool = True) -> Path | None:
        """Snapshot ``state`` at ``step`` (default: in :attr:`snapshot_dir`), keeping the newest ``keep``: per-step
        state in node-local memory for restarts, so a crashed rank costs at most the step in flight.

        Call it on every rank at the same step, between optimizer steps. Each rank copies its own part (a
        shard stays a shard) into shared memory: no collective, no pickling of tensors, so it is cheap enough
        for every step (bench/survival.py). The snapshot of a step counts once every rank has written it.
        With ``overlap`` the parameters and optimizer state are copied in the background during the next
        forward and backward (each optimizer waits for the copy before it steps; see
        :class:`phalanx.checkpoint.rank_snapshot.RankSnapshots`); ``overlap=False`` copies before returning.
        Resume with ``fabric.load(fabric.latest_checkpoint(checkpoint_dir, fabric.snapshot_dir), state)``: the
        newest complete state among checkpoints and snapshots, on the same topology (same strategy and
        ranks, same node). Returns the snapshot's reference (a path ``fabric.load`` accepts), or None when
        this rank could not write it (the message says why; restarts then use the disk checkpoints). The
        folder is removed when the job ends without an error."""
        folder = self._snapshot_folder(directory)
        strategy = self._strategy
        if not strategy.snapshots_in_memory:
            return self._snapshot_as_checkpoint(folder, state, step, keep)
        kept = self._snapshot_folders.get(folder)
        if kept is None:
            kept = RankSnapshots(folder, strategy.global_rank, strategy.world_size, keep, overlap)
            self._snapshot_folders[folder] = kept
        if not isinstance(kept, RankSnapshots):
            return None  # turned off on this rank after a failed write
        kept.overlap = overlap
        try:
            return snapshots.write(strategy, kept, step, state)
        except (CheckpointError, MisconfigurationError):
            raise  # the state cannot be snapshotted, or another run writes this folder: the user's to fix
        except (OSError, RuntimeError) as err:  # no room in shared memory, a mapping refused; not a bad state
            # This rank's earlier snapshots stay: a step counts only where every rank completed it, which the
            # ranks still writing soon overwrite, so a restart resumes from the newest state all ranks share.
            with contextlib.suppress(Exception):
                kept.close()
            self._snapshot_folders[folder] = []
            diagnostics.warn(f"Snapshots in {folder} are off on rank {strategy.global_rank}: writing the one of step "
                             f"{step} failed ({type(err).__name__}: {err}). Restarts resume from the disk checkpoints.",
                             rank=strategy.global_rank)
            return None

    def _snapshot_as_checkpoint(self, folder: Path, state: dict[str, Any], step: int, keep: int) -> Path:
        """A strategy whose state only its engine can read and write snapshots through checkpoint files."""
        written = self._snapshot_folders.get(folder, [])
        if isinstance(written, RankSnapshots):
            raise MisconfigurationError(f"{folder} holds shared-memory snapshots; give checkpoint snapshots another "
                                        "folder.")
        if folder not in self._snapshot_claims:  # refused while another run writes here
            self._snapshot_claims[folder] = FolderClaim(folder, self._strategy.global_rank)
            self._snapshot_folders[folder] = written
        if not written and self._strategy.global_rank == 0:
            diagnostics.notice(f"Snapshots under strategy {self._strategy.name!r} are checkpoints written through its "
                               "engine (collectives and a file per snapshot), not shared-memory copies: take them less "
                               "often than every step if the step time matters.")
        path = snapshots.path_for(folder, step)
        self.save(path, state)
        # What this job wrote, the same list on every rank (a listing of the folder could differ between ranks
        # while rank 0 deletes, and removing is a collective). An earlier attempt's go with the folder at the end.
        written[:] = [p for p in written if p != path] + [path]
        while len(written) > keep:
            self.remove_checkpoint(written.pop(0))
        return path

    def _settle_snapshots(self) -> None:
        """Every snapshot copy in flight on this rank is complete (an error surfaces at the next snapshot)."""
        for kept in self._snapshot_folders.values():
            if isinstance(kept, RankSnapshots):
                kept.wait(keep_errors=True)

    def remove_snapshots(self, directory: str | Path | None = None) -> None:
        """Delete the snapshots in ``directory`` (default: :attr:`snapshot_dir`) once this rank's last copy is
        complete: each rank removes its own part, the last one the folder (no collective)."""
        folder = self._snapshot_folder(directory)
        kept = self._snapshot_folders.pop(folder, None)
        claim = self._snapshot_claims.pop(folder, None)
        if isinstance(kept, RankSnapshots):
            _finish(kept, remove=True)
        elif self._strategy.global_rank == 0:
            claim = claim or FolderClaim.attempt(folder, 0)
            if claim is not None:  # nothing is deleted while another run writes there
                shutil.rmtree(folder, ignore_errors=True)
        if claim is not None:
            claim.release()

    def close_snapshots(self, directory: str | Path | None = None) -> None:
        """Complete this rank's last snapshot in ``directory`` (default: :attr:`snapshot_dir`) and let go of the
        folder, keeping its snapshots: what a run that did not finish leaves for its restart or rerun, which
        may be another Trainer or Fabric in this same process (no collective)."""
        folder = self._snapshot_folder(directory)
        kept = self._snapshot_folders.pop(folder, None)
        claim = self._snapshot_claims.pop(folder, None)
        if isinstance(kept, RankSnapshots):
            _finish(kept, remove=False)
        if claim is not None:
            claim.release()

    def _drop_snapshots(self, failed: bool) -> None:
        """At the end of the job: snapshots are only for restarting a run that did not finish, so they are
        removed after a success and completed (for the restart) after a failure."""
        for folder in list(self._snapshot_folders):
            if failed:
                self.close_snapshots(folder)
            else:
                self.remove_snapshots(folder)

    def _snapshot_folder(self, directory: str | Path | None) -> Path:
        if isinstance(directory, Path) and directory.is_absolute():
            return directory  # the per-step case (the Snapshot callback's folder): no path parsing
        return (Path(directory) if directory is not None else self.snapshot_dir).absolute()

    @property
    def restart_count(self) -> int:
        """How many times the launcher restarted this job's processes (0 on the first attempt)."""
        return restart_count()


def _finish(kept: RankSnapshots, remove: bool) -> None:
    """Complete this rank's last snapshot copy (and with ``remove`` delete its files). A failure is reported,
    not raised: the job's own outcome matters more than its last snapshot."""
    try:
        if remove:
            kept.remove()
        else:
            kept.close()
    except Exception as err:
        diagnostics.warn(f"The last snapshot in {kept.folder} failed on rank {kept.rank}: {err}", rank=kept.rank)
