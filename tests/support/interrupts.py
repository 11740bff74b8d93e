"""Interrupting a fit at a chosen step, as a kill would (tests/trainer/test_trainer_resume.py,
tests/support/combo_models.py and tests/integration/test_metrics.py)."""

from __future__ import annotations

from typing import Any


class Interrupt(Exception):
    pass


class StopAt:
    """Interrupts the fit right after optimizer step ``step`` (after the checkpoint of step - 1)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and not trainer.in_window:
            raise Interrupt
