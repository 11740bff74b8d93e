"""``LoopState``: where the training loop is, in one object the Trainer owns.

Every counter lives here, so a checkpoint, a resume and a tuning phase cannot miss one (a counter
missed is how a resumed run drifts from one that never stopped): ``state_dict``/``load_state_dict`` is
what a checkpoint stores, ``restore_point``/``restore`` is everything, for a tuning phase that must
leave no trace.

The step path reads and bumps these counters at every batch, so the class has slots and the loops
hold it in a local.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(slots=True)
class LoopState:
    """The training loop's position. ``trainer.global_step`` and friends read and write these fields."""

    global_step: int = 0  # optimizer steps taken (Lightning's global_step)
    current_epoch: int = 0
    batches_done: int = 0  # training batches finished in the current epoch
    stop_requested: bool = False  # trainer.should_stop as set; it takes effect once the minimums are met
    epoch_finished: bool = False  # the epoch's batches ran; its end-of-epoch hooks run now
    in_window: bool = False  # inside a gradient-accumulation window (no checkpoint may be taken)
    epoch_start_rng: dict[str, Any] | None = None  # this rank's RNG states when the epoch began
    # Samples consumed minus batches_done x this run's global batch: nonzero only in an epoch resumed from
    # a checkpoint of another batch size at a sample that is no multiple of this one (loops.resume_start).
    samples_offset: int = 0
    # This replica group took a live peer's state in the step that just ran (fault tolerance): the epoch in
    # progress ends there and the loop goes on from the peer's position (loops.run_train_epoch).
    healed: bool = False

    def state_dict(
        self, world_size: int, samples_per_batch: int, composition: tuple[int, int, int] = (0, 0, 1)
    ) -> dict[str, Any]:
        """The counters a checkpoint stores (its ``"loops"`` entry). A checkpoint taken while an epoch's
        end hooks run counts that epoch as done, so resuming starts the next one. ``composition``: the data
        ranks, the batch size and the accumulation that made ``samples_per_batch`` (0 where unknown), so
        a run with another global batch size can say how its steps relate to these."""
        done = self.epoch_finished
        replicas, batch_size, accumulate = composition
        return {
            "epoch": self.current_epoch + 1 if done else self.current_epoch,
            "batches_done": 0 if done else self.batches_done,
            "global_step": self.global_step,
            "should_stop": self.stop_requested,  # the request as made (the minimums apply after resuming too)
            "world_size": world_size,
            "samples_consumed": 0 if done else max(0, self.batches_done * samples_per_batch + self.samples_offset),
            "data_replicas": replicas,
            "batch_size": batch_size,
            "accumulate_grad_batches": accumulate,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` stored."""
        self.current_epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        self.batches_done, self.samples_offset = int(state["batches_done"]), 0
        self.stop_requested = bool(state["should_stop"])
        self.epoch_finished = self.in_window = False

    def restore_point(self) -> LoopState:
        """A copy of every field (the RNG states are never mutated in place, so sharing them is safe)."""
        return dataclasses.replace(self)

    def restore(self, saved: LoopState) -> None:
        """Make this object (the one the loops and optimizers hold) equal to ``saved``."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(saved, f.name))
