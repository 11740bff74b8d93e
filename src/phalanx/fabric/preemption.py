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
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from phalanx import checkpoint
from phalanx.distributed.launch import record_failure, restart_count
from phalanx.distributed.preemption import Preempted, PreemptionSignals, Stop, requeue_slurm_job

if TYPE_CHECKING:
    from phalanx.strategies import Strategy


class PreemptionMethods:
    """The preemption and restart calls of a Fabric."""

    _strategy: Strategy
    _preemption: PreemptionSignals
    _stop: Stop | None

    if TYPE_CHECKING:
        def _ensure_launched(self) -> None: ...

        @property
        def global_rank(self) -> int: ...

        @property
        def world_size(self) -> int: ...

        @property
        def is_global_zero(self) -> bool: ...

        def broadcast(self, obj: Any, src: int = 0) -> Any: ...

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
        self._stop = self._preemption.agree(self.global_rank, self.world_size, self._agree_across_ranks)
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
                   + (" from it" if checkpoint_path is not None else "") + ".")
        error = Preempted(message)
        record_failure(error)  # what torch's launcher (and phalanx's) quotes for this rank
        if self.is_global_zero:
            print(f"[phalanx] {message}", file=sys.stderr, flush=True)
            if stop is not None and checkpoint_path is not None:
                requeue_slurm_job(lambda line: print(f"[phalanx] {line}", file=sys.stderr, flush=True))
        raise error

    def latest_checkpoint(self, directory: str | Path, *more: str | Path) -> Path | None:
        """The newest complete checkpoint in ``directory`` (and the other directories given): a file, or a
        sharded directory whose save finished; None when there is none. Interrupted saves are skipped.
        With more than one process, rank 0 decides and every rank gets its answer (call it on every rank)."""
        dirs = [Path(directory), *map(Path, more)]
        if self.world_size > 1:
            self._ensure_launched()
            found = checkpoint.latest(dirs) if self.is_global_zero else None
            answer = self.broadcast(str(found) if found is not None else None)
            return Path(answer) if answer is not None else None
        return checkpoint.latest(dirs)

    @property
    def restart_count(self) -> int:
        """How many times the launcher restarted this job's processes (0 on the first attempt)."""
        return restart_count()
