"""``BatchSizeFinder``: run the batch-size search when fit (or validate/test/predict) starts.

The search leaves no trace except the batch-size attribute it sets (see
:mod:`phalanx.tuner.batch_size`); when a fit resumes from a checkpoint, the search is skipped and
the size found before is restored from the callback's state.
"""

from __future__ import annotations

from typing import Any

from phalanx.callbacks.base import Callback
from phalanx.tuner.batch_size import scale_batch_size, set_size


class BatchSizeFinder(Callback):
    skip_in_fast_dev_run = True  # it tunes: fast_dev_run is a smoke test

    def __init__(
        self, mode: str = "power", steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
        batch_arg_name: str = "batch_size", margin: float = 0.05, max_val: int = 8192,
    ) -> None:
        self.mode, self.steps_per_trial, self.init_val = mode, steps_per_trial, init_val
        self.max_trials, self.batch_arg_name, self.margin, self.max_val = max_trials, batch_arg_name, margin, max_val
        self.optimal_batch_size: int | None = None

    def scale_batch_size(self, trainer: Any, module: Any, method: str) -> None:
        if self.optimal_batch_size is not None and method == "fit" and trainer.ckpt_path is not None:
            set_size(trainer, self.batch_arg_name, self.optimal_batch_size)
            trainer.data.prepare_train(trainer.module)
            return
        self.optimal_batch_size = scale_batch_size(
            trainer, module, method=method, mode=self.mode, steps_per_trial=self.steps_per_trial,
            init_val=self.init_val, max_trials=self.max_trials, batch_arg_name=self.batch_arg_name,
            margin=self.margin, max_val=self.max_val,
        )

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.scale_batch_size(trainer, module, "fit")

    def state_dict(self) -> dict[str, Any]:
        return {"optimal_batch_size": self.optimal_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimal_batch_size = state.get("optimal_batch_size")
