"""What a Fabric loop is told when its job is asked to stop: ``fabric.stop_requested``, ``exit_preempted``.

A loop that keeps its own control flow stays in charge: ``fabric.stop_requested()`` says, on every rank
at the same call, that a preemption signal arrived somewhere (see :mod:`phalanx.distributed.preemption`);
the loop saves as it always does and ends with ``fabric.exit_preempted(path)``, which records the complete
checkpoint in the run's folder (``preempted.json``, :class:`phalanx.distributed.runfolder.PreemptedRun`) so
that the next run of the same command resumes from it and no fresh start overwrites it. Where the next attempt
continues from is :mod:`phalanx.fabric.persistence`'s (``fabric.latest_checkpoint``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from phalanx import checkpoint
from phalanx.distributed import restarts
from phalanx.distributed.launch import record_failure
from phalanx.distributed.preemption import Preempted, PreemptionSignals, Stop, requeue_slurm_job
from phalanx.distributed.runfolder import PreemptedRun
from phalanx.utils.late_reads import LateRead, defers_host_reads

if TYPE_CHECKING:
    from phalanx.strategies import Strategy


class Preemption:
    """The preemption signals of one Fabric and the stop its ranks agreed on (:attr:`stop`, None until then).
    ``folder``: the run's folder, where a preempted run is recorded (None: the working directory)."""

    def __init__(self, strategy: Strategy, signals: PreemptionSignals, folder: Path | None = None) -> None:
        self._strategy, self.signals, self._folder = strategy, signals, folder
        self.stop: Stop | None = None
        self.exited = False  # exit() ran: this process ends preempted, its record stays for the rerun

    def stop_requested(self) -> bool:
        """Listen for the signals (from the first call on) and agree across ranks whether one arrived: one
        all-reduce of two integers, read two calls later where the collective runs on a GPU. Once agreed,
        the answer stays True without communicating again. The caller has joined the job."""
        if self.stop is not None:
            return True
        self.signals.install()
        strategy = self._strategy
        if strategy.world_size > 1 and defers_host_reads(strategy.root_device):
            self.stop = self.signals.agree_late(strategy.global_rank, strategy.world_size, self._agree_late)
        else:
            self.stop = self.signals.agree(strategy.global_rank, strategy.world_size, self._agree)
        return self.stop is not None

    def _agree(self, values: list[int]) -> list[int]:
        return self._strategy.max_across_ranks(values, "stop_requested")

    def _agree_late(self, values: list[int]) -> LateRead:
        return self._strategy.max_across_ranks_late(values, "stop_requested")

    def exit(self, checkpoint_path: str | Path | None, step: int | None) -> NoReturn:
        """Rank 0 records the run as preempted when its checkpoint is complete (the next run of the same
        command resumes from it), prints one line (step, signal, rank, checkpoint, how to resume) and, under
        SLURM, requeues the job; every rank raises :class:`Preempted` (exit code 75, no traceback)."""
        self.exited = True
        stop = self.stop
        cause = stop.describe() if stop is not None else "request"
        where = f" at step {step}" if step is not None else ""
        saved = f"checkpoint: {checkpoint_path}" if checkpoint_path is not None else "no checkpoint was written"
        since = self.signals.received_at
        took = f" ({time.monotonic() - since:.1f} s after the signal)" if since is not None else ""
        resume = " to resume"
        if checkpoint_path is not None:
            found = checkpoint.find(checkpoint_path)
            complete = found is not None and found.problem is None and not found.recovered
            if not complete:
                resume += (" from it once it is complete (its save had not finished: wait for the handle "
                           "fabric.save returned before exit_preempted)")
            elif self._strategy.global_rank == 0:
                resume += self._record(PreemptedRun.now(checkpoint_path, step, cause))
        # A replica group cannot know whether the others were preempted too: those that were not go on.
        after = ("Replica groups that were not preempted go on without this one; once every group has stopped, run "
                 "the same command again" if self._strategy.replica_groups is not None else
                 "Run the same command again")
        message = f"preempted{where} by {cause}; {saved}{took}. {after}{resume}." + restarts.logs_named()
        error = Preempted(message)
        record_failure(error)  # what torch's launcher (and phalanx's) quotes for this rank
        if self._strategy.global_rank == 0:
            print(f"[phalanx] {message}", file=sys.stderr, flush=True)
            if stop is not None and checkpoint_path is not None:
                requeue_slurm_job(lambda line: print(f"[phalanx] {line}", file=sys.stderr, flush=True))
        raise error

    def _record(self, run: PreemptedRun) -> str:
        """Record the preempted run in its folder; how the rerun resumes, in words."""
        folder = self._folder or Path.cwd()
        try:
            run.write(folder)
        except OSError as err:
            return (f" from it, loading it explicitly: recording the run in {PreemptedRun.path(folder)} failed "
                    f"({err}), so a rerun does not find it by itself")
        return " from it"


__all__ = ["Preemption"]
