"""Frequent snapshots in node-local shared memory, so a crashed rank costs only the steps since the last one.

Periodic disk checkpoints lose up to their interval when a rank dies; writing one to a shared file
system every step costs too much. A snapshot holds what a Trainer checkpoint holds, but each rank copies
its own part into ``/dev/shm`` (memory: it outlives the processes, not the node) with plain memory copies
and no collective, overlapping the next step (:mod:`phalanx.checkpoint.snapshot`); each is complete or
ignored, and the newest ``keep`` are kept. How often: by default as often as ``max_overhead`` of the run's
time allows, measured as the run goes (:class:`phalanx.checkpoint.snapshot.Cadence`: the stall it causes
within the budget, and each one complete before the next), or every ``every_n_train_steps`` steps when that
is an int. On a GPU the device copies the state straight into shared memory registered with CUDA (one copy,
on a side stream; :mod:`phalanx.checkpoint.snapshot.device`).

A restarted attempt (``Trainer(max_restarts=K)``, ``torchrun --max-restarts K``)
resumes from the newest complete state among snapshots and checkpoints, the same one on every rank
(:meth:`phalanx.trainer.checkpoint_connector.CheckpointConnector.newest_resumable`, decided on rank 0).

The folder is named after the run's ``default_root_dir``, so a restart or a rerun of the same command
finds it, and it is removed when the fit ends normally. A node whose shared memory is gone (rebooted,
replaced) has no snapshot: the restart resumes from the disk checkpoint and says so. Single-node jobs
only: on several nodes each rank could not read the snapshot another node's shared memory holds, so
the callback turns itself off there (with a message) and the disk checkpoints apply.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from phalanx.callbacks.base import Callback
from phalanx.checkpoint import snapshot
from phalanx.checkpoint.snapshot import Cadence
from phalanx.fabric.anomaly import NonFiniteError
from phalanx.utils import diagnostics
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.module import Module


class Snapshot(Callback):
    """Write a complete, resumable snapshot of the fit to node-local shared memory every few steps.

    Args:
        every_n_train_steps: ``"auto"`` (the default): as often as ``max_overhead`` allows, measured during the
            fit, the same steps on every rank; the choice is said once, and this attribute then holds the number
            of steps in effect. An int: after every this many optimizer steps (1: after every step).
        max_overhead: under ``"auto"``, the share of the fit's time snapshots may cost (0.05: 5 %).
        dirpath: where (default: under ``/dev/shm``, see :func:`phalanx.checkpoint.snapshot.default_dir`,
            named after the run's ``default_root_dir``); any folder works, but
            one on a network file system costs what a disk checkpoint costs.
        keep: how many of the newest snapshots to keep (at least 1; 2 keeps one complete snapshot even
            while the next is written).
        overlap: copy the parameters and optimizer state while the next batch runs forward and backward (the
            optimizer waits for the copy before it steps: on a GPU, on the device). A rank killed before the copy
            ends loses that snapshot, so a restart recomputes the steps since the one before.
            ``False``: copied before the callback returns.
    """

    skip_in_fast_dev_run: ClassVar[bool] = True

    def __init__(self, every_n_train_steps: int | str = "auto", dirpath: str | Path | None = None, keep: int = 2,
                 overlap: bool = True, max_overhead: float = 0.05) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise MisconfigurationError(f"Snapshot(keep={keep!r}): keep at least 1 snapshot.")
        try:
            self._cadence = Cadence(every_n_train_steps, max_overhead)
        except MisconfigurationError as err:
            raise MisconfigurationError(f"Snapshot: {err} (every_n_train_steps is every_n_steps here)") from None
        self.keep, self.overlap = keep, overlap
        self._given = Path(dirpath).absolute() if dirpath is not None else None
        #: The folder in use during a fit (None when snapshots are off): where a restart looks.
        self.snapshot_dirpath: Path | None = None

    @property
    def every_n_train_steps(self) -> int | None:
        """Steps between snapshots: the int given, or under "auto" the one chosen (None before the first)."""
        return self._cadence.every_n_steps

    @property
    def cadence(self) -> Cadence:
        """The decision and what it was made on (step and snapshot time, see :class:`Cadence`)."""
        return self._cadence

    def setup(self, trainer: Any, module: Module, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.num_nodes > 1:
            diagnostics.notice(
                "Snapshot is off: the job spans several nodes, and a snapshot in one node's shared memory cannot be "
                "read on the others. Restarts resume from the disk checkpoints (ModelCheckpoint).",
                rank=trainer.global_rank,
            )
            return
        folder = self._given or snapshot.default_dir(trainer.default_root_dir)
        if not snapshot.usable(folder):
            diagnostics.notice(
                f"Snapshot is off: {folder} cannot be written (no node-local shared memory here?). Restarts resume "
                "from the disk checkpoints; pass Snapshot(dirpath=...) to snapshot elsewhere.",
                rank=trainer.global_rank,
            )
            return
        self.snapshot_dirpath = folder
        if self._cadence.auto:  # measured anew for each fit
            self._cadence = Cadence("auto", self._cadence.max_overhead)

    def on_train_batch_end(
        self, trainer: Any, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        folder = self.snapshot_dirpath
        if folder is None or trainer.in_window or trainer.global_step == 0:
            return
        # Every rank, every step (the cadence measures the steps); each writes its own part when one is due.
        trainer.save_snapshot(folder, self.keep, self.overlap, self._cadence, self._cadence.max_overhead)

    def on_exception(self, trainer: Any, module: Module, exception: BaseException) -> None:
        folder = self.snapshot_dirpath
        if folder is not None and isinstance(exception, NonFiniteError):
            # Losses are read late on a GPU: snapshots taken since the non-finite one may hold its effect.
            self.snapshot_dirpath = None
            trainer.fabric.remove_snapshots(folder)

    def teardown(self, trainer: Any, module: Module, stage: str) -> None:
        folder = self.snapshot_dirpath
        if stage != "fit" or folder is None:
            return
        self.snapshot_dirpath = None
        # Kept when the fit did not finish (a crash, a preemption): that is what a restart resumes from, or a
        # rerun, which may be a new Trainer in this process (a notebook): the folder is let go of either way.
        if getattr(trainer, "interrupted", False):
            trainer.fabric.close_snapshots(folder)
        else:
            trainer.fabric.remove_snapshots(folder)
