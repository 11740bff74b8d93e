"""What a resumed run says: one line on rank 0, ``Resumed from PATH at step N (epoch E).``

On a restarted attempt (torch's agent restarted the ranks: ``Trainer(max_restarts=K)``, ``Fabric(max_restarts=K)``,
``phalanx run --max-restarts K``, ``torchrun --max-restarts K``) the first such line also says which attempt
this is, what failed in the previous one (the launcher's summary, :data:`~phalanx.distributed.failures.CAUSE_VARIABLE`)
and where the run's logs are (:data:`~phalanx.distributed.runlogs.RUN_VARIABLE`)::

    [phalanx] Restart 1 of at most 2: rank 1 was killed by SIGKILL; rank 0 stopped as a consequence. Resumed
    from run/checkpoints/last.ckpt at step 8 (epoch 1). Logs: run/phalanx_logs/phalanx-5b0c1e9a

The Trainer says it when it restores (or finds nothing to restore); a Fabric loop when it loads what
``fabric.latest_checkpoint`` found, when that found nothing, or else at its first ``fabric.backward``.
"""

from __future__ import annotations

import os
from pathlib import Path

from phalanx.distributed.failures import CAUSE_VARIABLE
from phalanx.distributed.launch import restart_count
from phalanx.distributed.runlogs import RUN_VARIABLE, shown_path
from phalanx.utils import diagnostics

#: Whether this process (one attempt of one rank) has yet to say where a restarted attempt started; None: not
#: asked yet (read once: it is asked at every fabric.backward until said).
_pending: bool | None = None


def pending() -> bool:
    """Whether this is a restarted attempt that has not yet said where it resumed."""
    global _pending
    if _pending is None:
        _pending = restart_count() > 0
    return _pending


def logs_named() -> str:
    """`` Logs: <folder>`` under a launcher phalanx owns, else ''."""
    folder = os.environ.get(RUN_VARIABLE)
    return f" Logs: {shown_path(folder)}" if folder else ""


def _say(what: str, rank: int) -> None:
    global _pending
    first, _pending = pending(), False
    if rank != 0:
        return
    if not first:
        diagnostics.notice(f"{what}.")
        return
    attempt = restart_count()
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    of = f" of at most {limit}" if limit else ""
    cause = os.environ.get(CAUSE_VARIABLE) or "a rank failed (the launcher's output names it)"
    diagnostics.notice(f"Restart {attempt}{of}: {cause}. {what}.{logs_named()}")


def resumed(path: str | Path, step: int | None, epoch: int | None, rank: int, why: str = "") -> None:
    """Say (rank 0) where the run resumed: the checkpoint and, where known, its step and epoch (and ``why``)."""
    at = f" at step {step}" if step is not None else ""
    of = f" (epoch {epoch})" if epoch is not None else ""
    _say(f"Resumed from {path}{at}{of}{why}", rank)


def started_over(why: str, rank: int) -> None:
    """Say (rank 0) that a restarted attempt did not resume, and ``why``; nothing on a first attempt."""
    if pending():
        _say(why, rank)


def healed(what: str, rank: int) -> None:
    """Say (rank 0) that this replica group took its state from a live peer (``what``): on a restarted attempt with
    the restart's cause in front, as :func:`resumed` does."""
    _say(what, rank)


__all__ = ["healed", "logs_named", "pending", "resumed", "started_over"]
