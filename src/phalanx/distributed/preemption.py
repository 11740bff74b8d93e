"""Preemption: a signal on any rank (or on the launcher) stops every rank at the same step.

Clusters announce the end of a job with a signal: Kubernetes and most schedulers send SIGTERM and
SIGKILL a grace period later, SLURM sends SIGUSR1 (``--signal=USR1@90``) ahead of the time limit.
The default reaction, dying at once, loses every step since the last checkpoint; a rank that acts
alone on its own signal (saving while the others go on into the next all-reduce) hangs the job.

So a signal is only *recorded* here (the handler does nothing else: it may run between any two
bytecodes, even inside a collective's Python wrapper). The training loop asks at each optimizer-step
boundary whether any rank received one (:meth:`PreemptionSignals.agree`, one all-reduce of two
integers, skipped on a single process); every rank gets the same answer at the same step, so they
all save one checkpoint together and exit with :data:`EXIT_PREEMPTED`. Where the all-reduce runs on a
GPU, its answer is read :data:`AGREEMENT_LAG` steps later (:meth:`PreemptionSignals.agree_late`), still
the same step on every rank, so asking never makes the GPU wait.

A second signal while that checkpoint is written is recorded and otherwise ignored: the save
finishes (it is atomic either way: an interrupted save never replaces the previous checkpoint).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.late_reads import LateRead

#: The exit code of every rank (and of phalanx's launchers) after a preemption checkpoint was written:
#: sysexits' EX_TEMPFAIL, "a temporary failure; the user is invited to retry". Not 0, so a scheduler does
#: not mark the job done; not 1, so scripts can tell "rerun to resume" from a crash.
EXIT_PREEMPTED = 75

#: The signals treated as preemption unless configured otherwise (``PHALANX_PREEMPTION_SIGNALS``,
#: comma-separated names, or ``none``).
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
#: Calls between starting an agreement on a device and reading it (:meth:`PreemptionSignals.agree_late`).
AGREEMENT_LAG = 2
SIGNALS_VARIABLE = "PHALANX_PREEMPTION_SIGNALS"


def resolve_signals(signals: Iterable[str | int] | None = None) -> tuple[signal.Signals, ...]:
    """The signals to handle: ``signals`` if given, else ``PHALANX_PREEMPTION_SIGNALS``, else SIGTERM and SIGUSR1."""
    if signals is None:
        text = os.environ.get(SIGNALS_VARIABLE)
        if text is None:
            signals = DEFAULT_SIGNALS
        else:
            signals = [] if text.strip().lower() in ("", "none", "0") else [s.strip() for s in text.split(",")]
    out = []
    for item in signals:
        try:
            sig = signal.Signals(item) if isinstance(item, int) else signal.Signals[
                item.upper() if item.upper().startswith("SIG") else f"SIG{item.upper()}"]
        except (KeyError, ValueError):
            raise MisconfigurationError(
                f"Unknown preemption signal {item!r}: give signal names such as 'SIGTERM', 'SIGUSR1' or 'USR2' "
                f"(in {SIGNALS_VARIABLE} comma-separated, or 'none' to turn preemption handling off)."
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise MisconfigurationError(f"{sig.name} cannot be caught; it cannot be a preemption signal.")
        out.append(sig)
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class Stop:
    """What the ranks agreed on: the signal and the lowest rank that received it."""

    signal: signal.Signals
    rank: int

    def describe(self) -> str:
        return f"{self.signal.name} on rank {self.rank}"


class PreemptionSignals:
    """Records the preemption signals this process receives, from :meth:`install` until :meth:`uninstall`.

    One per Fabric; the handlers are the process's (signals are), and the previous ones come back on
    :meth:`uninstall`. Installing needs the main thread (Python's rule); elsewhere it is a no-op and
    :attr:`active` stays False."""

    def __init__(self, signals: Iterable[str | int] | None = None) -> None:
        self.signals = resolve_signals(signals)
        self.received: signal.Signals | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self.count = 0
        self.active = False
        self._previous: dict[signal.Signals, Any] = {}
        self._pending: deque[LateRead] = deque()  # agreements started, not read yet (agree_late)

    def install(self) -> bool:
        if self.active or not self.signals or threading.current_thread() is not threading.main_thread():
            return self.active
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self.active = True
        return True

    def uninstall(self) -> None:
        if not self.active:
            return
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self.active = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only record: the loop acts at the next step boundary, together with the other ranks.
        self.count += 1
        if self.received is None:
            self.received = signal.Signals(signum)
            self.received_at = time.monotonic()

    def _mine(self, rank: int, world_size: int) -> list[int]:
        return [int(self.received) if self.received is not None else 0,
                world_size - rank if self.received is not None else 0]  # max picks the lowest such rank

    @staticmethod
    def _stop(agreed: list[int], world_size: int) -> Stop | None:
        return Stop(signal.Signals(agreed[0]), world_size - agreed[1]) if agreed[0] else None

    def agree(self, rank: int, world_size: int, max_across_ranks: Callable[[list[int]], list[int]]) -> Stop | None:
        """Whether any rank received a signal, the same answer on every rank (a collective when
        ``world_size > 1``: every rank must call it at the same point)."""
        mine = self._mine(rank, world_size)
        return self._stop(max_across_ranks(mine) if world_size > 1 else mine, world_size)

    def agree_late(self, rank: int, world_size: int, start: Callable[[list[int]], LateRead]) -> Stop | None:
        """:meth:`agree` without reading a device value now: each call starts the agreement on this call's
        signals and reads the one started :data:`AGREEMENT_LAG` calls earlier (long complete: the read never
        drains the device's queue). The same answer on every rank, :data:`AGREEMENT_LAG` calls later."""
        self._pending.append(start(self._mine(rank, world_size)))
        if len(self._pending) <= AGREEMENT_LAG:
            return None
        return self._stop([int(v) for v in self._pending.popleft().values()], world_size)


def requeue_slurm_job(log: Callable[[str], None]) -> bool:
    """Ask SLURM to requeue this job (``scontrol requeue $SLURM_JOB_ID``); True when it accepted.

    Called by rank 0 after the preemption checkpoint is complete, so the requeued job finds it. Set
    ``PHALANX_SLURM_REQUEUE=0`` to leave requeueing to the batch script."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("PHALANX_SLURM_REQUEUE", "1") == "0":
        return False
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        log(f"SLURM job {job}: scontrol is not on PATH, so the job was not requeued; resubmit it to resume.")
        return False
    try:
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log(f"SLURM job {job}: `scontrol requeue {job}` failed ({err}); resubmit the job to resume.")
        return False
    if done.returncode != 0:
        log(f"SLURM job {job}: `scontrol requeue {job}` failed with exit code {done.returncode}: "
            f"{(done.stderr or done.stdout).strip()[:300]} (is the job requeueable? sbatch --requeue); resubmit it.")
        return False
    log(f"SLURM job {job} requeued: it resumes from this checkpoint when it starts again.")
    return True


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is written; ends the process with
    :data:`EXIT_PREEMPTED` and no traceback (it is a SystemExit)."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.message = message

    def __str__(self) -> str:
        return self.message
