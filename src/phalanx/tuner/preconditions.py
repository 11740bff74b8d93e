"""What a strategy must allow before either tuner (the LR finder, the batch-size finder) can search on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.tuner.view import TunedTrainer


def refuse_without_separate_optimizers(trainer: TunedTrainer, tuner: str, where: str) -> None:
    """The tuners search with an optimizer of their own and the fit then builds the real one: a
    strategy that builds its engine once from the model and its optimizer (DeepSpeed) cannot, once the
    model is set up (a standalone ``lr_find`` before the fit searches on a scratch copy instead)."""
    strategy = trainer.fabric.strategy
    if not strategy.sets_up_optimizers_separately:
        raise MisconfigurationError(
            f"Tuner.{tuner} is not supported on {type(strategy).__name__} {where}: it builds one engine from the "
            f"model and its optimizer, and the search needs an optimizer of its own before the fit builds the real "
            f"one. Call Tuner(trainer).lr_find(model, ...) before trainer.fit (it searches on a copy of the model), "
            f"or run {tuner} in a separate job with strategy='ddp' (same module, data and devices) and pass the "
            "value it finds to this run."
        )
