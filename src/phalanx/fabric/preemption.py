"""Fabric's calls for runs that survive: ``stop_requested``, ``exit_preempted``, ``latest_checkpoint``.

A loop that keeps its own control flow stays in charge: ``fabric.stop_requested()`` says, on every rank
at the same call, that a preemption signal arrived somewhere (see :mod:`phalanx.distributed.preemption`);
the loop saves as it always does and ends with ``fabric.exit_preempted(path)``. Under a restarting
launcher (``Fabric(max_restarts=K)``, ``torchrun --max-restarts K``) or a requeued job, the next attempt
finds where to continue with ``fabric.latest_checkpoint(directory)``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from phalanx import checkpoint
from phalanx.checkpoint import snapshot
from phalanx.checkpoint.snapshot import Cadence
from phalanx.distributed import restarts
from phalanx.distributed.launch import record_failure, restart_count
from phalanx.distributed.preemption import Preempted, PreemptionSignals, Stop, requeue_slurm_job
from phalanx.offline.summary import counters
from phalanx.utils.late_reads import LateRead, defers_host_reads

if TYPE_CHECKING:
    from phalanx.fabric.snapshots import Snapshots
    from phalanx.strategies import Strategy


class PreemptionMethods:
    """The preemption and restart calls of a Fabric."""

    _strategy: Strategy
    _preemption: PreemptionSignals
    _stop: Stop | None
    _snapshots: Snapshots
    #: What :meth:`latest_checkpoint` found last: loading it is resuming, and ``fabric.load`` says so.
    _latest: Path | None

    if TYPE_CHECKING:
        def _ensure_launched(self) -> None: ...

    def stop_requested(self) -> bool:
        """True on every rank, at the same call, once any rank received a preemption signal (SIGTERM or
        SIGUSR1 by default: ``Fabric(preemption_signals=...)`` or ``PHALANX_PREEMPTION_SIGNALS``).

        Call it on every rank at the same point of the loop, e.g. after each optimizer step: with more
        than one process it is a collective (one all-reduce of two integers). The first call starts
        listening for the signals; until then they keep their default effect (SIGTERM ends the process),
        so a loop that never asks is not left running after its scheduler asked it to stop. Once True, it
        stays True without communicating again. Where the collective runs on a GPU, its answer is read two calls
        later (still the same call on every rank), so asking never makes the GPU wait for the host."""
        self._ensure_launched()
        if self._stop is not None:
            return True
        self._preemption.install()
        strategy = self._strategy
        if strategy.world_size > 1 and defers_host_reads(strategy.root_device):
            self._stop = self._preemption.agree_late(strategy.global_rank, strategy.world_size,
                                                     self._agree_across_ranks_late)
        else:
            self._stop = self._preemption.agree(strategy.global_rank, strategy.world_size, self._agree_across_ranks)
        return self._stop is not None

    def release_signals(self) -> None:
        """Stop listening: the preemption signals get their previous handlers back (SIGTERM ends the process
        again). The next :meth:`stop_requested` listens anew; an agreed stop stays agreed."""
        self._preemption.uninstall()

    def _agree_across_ranks(self, values: list[int]) -> list[int]:
        return self._strategy.max_across_ranks(values, "stop_requested")

    def _agree_across_ranks_late(self, values: list[int]) -> LateRead:
        return self._strategy.max_across_ranks_late(values, "stop_requested")

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
        self._snapshots.settle()
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
        return snapshot.default_dir(Path.cwd(), sys.argv[0] if sys.argv and sys.argv[0] else "python")

    def save_snapshot(self, state: dict[str, Any] | Callable[[], dict[str, Any]], step: int,
                      directory: str | Path | None = None, keep: int = 2, overlap: bool = True,
                      every_n_steps: int | str | Cadence = "auto", max_overhead: float = 0.05) -> Path | None:
        """Snapshot ``state`` at ``step`` when one is due (default folder: :attr:`snapshot_dir`), keeping the
        newest ``keep``: per-step state in node-local memory for restarts, so a crashed rank costs only the
        steps since the last snapshot.

        Call it on every rank at every step, between optimizer steps; ``state`` may be a function that builds
        the dict (called only when a snapshot is due). ``every_n_steps``: an int snapshots when ``step`` is a
        multiple of it; ``"auto"`` (the default) measures the step and the snapshot and snapshots as often as
        ``max_overhead`` (a share of the run's time) allows, the same steps on every rank, and says its choice
        once (:class:`phalanx.checkpoint.snapshot.Cadence`; pass your own Cadence to read it). Each rank copies
        its own part (a shard stays a shard) into shared memory: no collective, no pickling of tensors. With
        ``overlap`` the parameters and optimizer state are copied while the next forward and backward run (on
        a GPU: on a side stream into pinned memory, the next optimizer step waiting on the device), and each
        optimizer waits for the copy before it steps; ``overlap=False`` copies before returning. The snapshot
        of a step counts once every rank has written it.

        Resume with ``fabric.load(fabric.latest_checkpoint(checkpoint_dir, fabric.snapshot_dir), state)``: the
        newest complete state among checkpoints and snapshots, on the same topology (same strategy and ranks,
        same node). Returns the reference of the snapshot written at this call (a path ``fabric.load``
        accepts), or None when none was (not due, or this rank could not write it: the message says why;
        restarts then use the disk checkpoints). The folder is removed when the job ends without an error."""
        return self._snapshots.save(self._snapshot_folder(directory), state, step, keep, overlap, every_n_steps,
                                    max_overhead)

    def remove_snapshots(self, directory: str | Path | None = None) -> None:
        """Delete the snapshots in ``directory`` (default: :attr:`snapshot_dir`) once this rank's last copy is
        complete: each rank removes its own part, the last one the folder (no collective)."""
        self._snapshots.remove(self._snapshot_folder(directory))

    def close_snapshots(self, directory: str | Path | None = None) -> None:
        """Complete this rank's last snapshot in ``directory`` (default: :attr:`snapshot_dir`) and let go of the
        folder, keeping its snapshots: what a run that did not finish leaves for its restart or rerun, which
        may be another Trainer or Fabric in this same process (no collective)."""
        self._snapshots.close(self._snapshot_folder(directory))

    def _snapshot_folder(self, directory: str | Path | None) -> Path:
        if isinstance(directory, Path) and directory.is_absolute():
            return directory  # the per-step case (the Snapshot callback's folder): no path parsing
        return (Path(directory) if directory is not None else self.snapshot_dir).absolute()

    @property
    def restart_count(self) -> int:
        """How many times the launcher restarted this job's processes (0 on the first attempt)."""
        return restart_count()

