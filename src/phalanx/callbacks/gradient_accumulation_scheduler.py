"""``GradientAccumulationScheduler``: accumulate a different number of batches from given epochs on."""

from __future__ import annotations

from typing import Any

from phalanx.callbacks.base import Callback
from phalanx.core.accumulation import AccumulationSchedule
from phalanx.utils.errors import MisconfigurationError


class GradientAccumulationScheduler(Callback):
    """``GradientAccumulationScheduler({0: 1, 4: 2, 8: 4})`` accumulates 2 batches from epoch 4 and 4 from
    epoch 8. It supplies :attr:`accumulation_schedule`, which the Trainer's training loop reads at each epoch
    start, so an epoch's windows are fixed before its first batch and accumulation keeps its meaning on every
    strategy. The Trainer refuses it together with ``Trainer(accumulate_grad_batches=N != 1)``, with a second
    schedule, and with manual optimization."""

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not scheduling:
            raise MisconfigurationError("GradientAccumulationScheduler(scheduling={}): give at least one epoch.")
        self.accumulation_schedule = AccumulationSchedule(scheduling)

    @property
    def scheduling(self) -> dict[int, int]:
        """``{first epoch: batches}`` in epoch order (epoch 0 included)."""
        return self.accumulation_schedule.scheduling

    def going_to_accumulate_grad_batches(self, epoch: int) -> int:
        """The accumulation of ``epoch``."""
        return self.accumulation_schedule.at(epoch)

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        if not module.automatic_optimization:
            raise MisconfigurationError("GradientAccumulationScheduler is for automatic optimization.")
