"""``LearningRateFinder``: run the LR range test at the start of fit and use its suggestion."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.callbacks.base import Callback
from phalanx.tuner.lr_find import LRFinderResult, Tuner, lr_attribute
from phalanx.tuner.view import TunedTrainer
from phalanx.utils.diagnostics import info
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.module import Module
    from phalanx.core.view import TrainerView


class LearningRateFinder(Callback):
    """At ``on_fit_start``: ``Tuner(trainer).lr_find(...)``, set ``model.lr``/``model.learning_rate``
    to the suggestion and rebuild the optimizer; when the search gives no suggestion (a warning says
    why), the fit goes on with the learning rate the model has. When the fit resumes from a
    checkpoint, the search is skipped (the restored optimizer already carries the learning rate) and
    the attribute is set from this callback's saved state.

    Args:
        min_lr, max_lr, num_training_steps, mode, early_stop_threshold, probe: see ``Tuner.lr_find``.
        attr_name: the model attribute to set ("" picks ``lr`` or ``learning_rate``).
        plot_path: where rank 0 saves the loss-vs-LR plot (PNG), if given.
    """

    skip_in_fast_dev_run = True  # it tunes: fast_dev_run is a smoke test

    def __init__(
        self, min_lr: float = 1e-8, max_lr: float = 1.0, num_training_steps: int = 100, mode: str = "exponential",
        early_stop_threshold: float | None = 4.0, attr_name: str = "", plot_path: str | Path | None = None,
        update_attr: bool = True, probe: bool = True,
    ) -> None:
        self.update_attr = update_attr  # False: only search (the result is in optimal_lr), change nothing
        self.min_lr, self.max_lr, self.num_training_steps = min_lr, max_lr, num_training_steps
        self.mode, self.early_stop_threshold, self.attr_name = mode, early_stop_threshold, attr_name
        self.plot_path = Path(plot_path) if plot_path is not None else None
        self.probe = probe
        self.optimal_lr: LRFinderResult | None = None  # the result of the search
        self.lr: float | None = None  # its suggestion (None: there was none)

    def on_fit_start(self, trainer: TrainerView, module: Module) -> None:
        if not isinstance(trainer, TunedTrainer):  # the search runs the Trainer's own loop pieces
            raise MisconfigurationError(f"LearningRateFinder runs in a phalanx.Trainer, not {type(trainer).__name__}.")
        if trainer.ckpt_path is not None:
            if self.lr is not None and self.update_attr:
                setattr(module, lr_attribute(module, self.attr_name), self.lr)
            return
        self.optimal_lr = result = Tuner(trainer).lr_find(
            module, min_lr=self.min_lr, max_lr=self.max_lr, num_training=self.num_training_steps, mode=self.mode,
            early_stop_threshold=self.early_stop_threshold, update_attr=self.update_attr, attr_name=self.attr_name,
            probe=self.probe,
        )
        self.lr = result.suggestion()
        if self.lr is not None and self.update_attr:
            info(f"LearningRateFinder: using lr={self.lr:.4g}", rank=trainer.global_rank)
        if self.plot_path is not None and trainer.is_global_zero:
            self.plot_path.parent.mkdir(parents=True, exist_ok=True)
            result.plot(suggest=True).savefig(self.plot_path)

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr = state["lr"]
