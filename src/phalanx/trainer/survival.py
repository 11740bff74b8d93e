"""The Trainer's side of runs that survive: stop on preemption, resume after a restart.

* **Preemption.** ``fabric.stop_requested()`` runs at every optimizer-step boundary (one all-reduce of two
  integers; see :mod:`phalanx.distributed.preemption`). When any rank received SIGTERM/SIGUSR1, every
  rank writes the same complete checkpoint (``last.ckpt`` in the first ModelCheckpoint's folder, or
  ``<log_dir>/checkpoints``) and the process ends with exit code 75 and one line on the terminal.
* **Restarts.** Under a restarting launcher (``Trainer(max_restarts=K)``, ``phalanx run --max-restarts K``,
  ``torchrun --max-restarts K``) a restarted attempt resumes by itself from the newest complete checkpoint
  or snapshot (:func:`phalanx.trainer.checkpointing.newest_resumable`), and says in one line what failed and
  where it resumed (:mod:`phalanx.distributed.restarts`); never silently from step 0. Rerunning the command
  after a preemption resumes with ``fit(ckpt_path="last")`` and says where too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from phalanx.distributed import restarts
from phalanx.trainer import checkpointing
from phalanx.utils import diagnostics

if TYPE_CHECKING:
    from phalanx.trainer.base import TrainerBase


def preemption_path(t: TrainerBase) -> Path:
    """Where the preemption checkpoint goes: ``last.ckpt`` where ``fit(ckpt_path="last")`` looks first."""
    folder = next((Path(cb.dirpath) for cb in t.checkpoint_callbacks if cb.dirpath), None)
    return (folder if folder is not None else Path(t.log_dir) / "checkpoints") / "last.ckpt"


def stop_for_preemption(t: TrainerBase) -> NoReturn:
    """Every rank: write the checkpoint, then end the process (exit code 75) with one line on rank 0."""
    path = preemption_path(t)
    checkpointing.save(t, path)
    t.fabric.exit_preempted(path, step=t.global_step)


def check_preemption(t: TrainerBase) -> None:
    """At an optimizer-step boundary, on every rank: stop here if any rank was asked to."""
    if t.fabric.stop_requested():
        stop_for_preemption(t)


def resume_after_restart(t: TrainerBase, ckpt_path: Any) -> Any:
    """``ckpt_path`` for this fit: as given, or on a restarted attempt (none given) the newest resumable state."""
    attempt = t.fabric.restart_count
    if ckpt_path is not None or attempt == 0:
        return ckpt_path
    found = checkpointing.newest_resumable(t) if t.is_global_zero else None
    found = t.fabric.broadcast(str(found) if found is not None else None)
    gone = [str(d) for cb in t.callbacks if (d := getattr(cb, "snapshot_dirpath", None)) and not any(d.glob("*"))]
    if gone and t.is_global_zero:
        diagnostics.notice(f"No snapshot in {', '.join(gone)} (this node's shared memory was cleared, or the node is "
                           f"another one): resuming from the disk checkpoint {found or '(none)'} instead.")
    if found is None:
        where = ", ".join(str(d) for d in checkpointing.checkpoint_dirs(t))
        restarts.started_over(
            f"No checkpoint to resume from in {where}: training starts again from step 0 (add "
            "ModelCheckpoint(save_last=True, every_n_train_steps=...) or phalanx.callbacks.Snapshot so that a restart "
            "continues where the failed attempt was)", t.global_rank)
    return found


def announce_resume(t: TrainerBase, path: Path | None) -> None:
    """After a fit restored ``path`` (a rerun's ``ckpt_path``, or a restart's newest state), say where it
    resumed (one line, rank 0; on a restarted attempt with what failed before)."""
    if path is not None:
        restarts.resumed(path, t.global_step, t.current_epoch, t.global_rank)
