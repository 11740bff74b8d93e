"""``Timer`` (and ``Trainer(max_time=...)``): stop training once a time budget is spent.

Every rank stops after the same optimizer step: rank 0's clock decides and the decision is broadcast
(ranks reading their own clocks would stop at different batches and leave the others in a collective).
Elapsed time is saved in checkpoints, so a resumed run keeps counting from where it stopped.
"""

from __future__ import annotations

import time
from typing import Any

from phalanx.callbacks.base import Callback
from phalanx.utils.duration import parse_duration
from phalanx.utils.errors import MisconfigurationError

_STAGES = ("train", "validate", "test", "predict")


class Timer(Callback):
    """Args:
        duration: ``"DD:HH:MM:SS"``, a ``timedelta`` or a dict such as ``{"hours": 2}``; None only measures.
        interval: check after every optimizer "step" or every "epoch".
    """

    def __init__(self, duration: Any = None, interval: str = "step", verbose: bool = True) -> None:
        if interval not in ("step", "epoch"):
            raise MisconfigurationError(f"Timer interval={interval!r}; use 'step' or 'epoch'.")
        self.duration = parse_duration(duration, "max_time").total_seconds() if duration is not None else None
        self.interval = interval
        self.verbose = verbose
        self._start: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._offset = 0.0  # training seconds before a resume

    def start_time(self, stage: str = "train") -> float | None:
        return self._start[stage]

    def end_time(self, stage: str = "train") -> float | None:
        return self._end[stage]

    def time_elapsed(self, stage: str = "train") -> float:
        start, end = self._start[stage], self._end[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return offset + ((end if end is not None else time.monotonic()) - start)

    def time_remaining(self, stage: str = "train") -> float | None:
        return None if self.duration is None else self.duration - self.time_elapsed(stage)

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._start["train"], self._end["train"] = time.monotonic(), None

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self._end["train"] = time.monotonic()

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        self._start["validate"], self._end["validate"] = time.monotonic(), None

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self._end["validate"] = time.monotonic()

    def on_test_start(self, trainer: Any, module: Any) -> None:
        self._start["test"], self._end["test"] = time.monotonic(), None

    def on_test_end(self, trainer: Any, module: Any) -> None:
        self._end["test"] = time.monotonic()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.interval == "step" and not trainer.in_window:
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if self.interval == "epoch":
            self._check(trainer)

    def _check(self, trainer: Any) -> None:
        if self.duration is None or trainer.sanity_checking:
            return
        # Rank 0 decides for everyone: the ranks' clocks differ.
        stop = bool(trainer.fabric.broadcast(self.time_elapsed("train") >= self.duration))
        if stop and not trainer.should_stop:
            trainer.should_stop = True
            if self.verbose:
                trainer.print(f"[phalanx] Timer: time budget of {self.duration:.0f}s is spent; stopping training.")

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {"train": self.time_elapsed("train")}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._offset = float(state.get("time_elapsed", {}).get("train", 0.0))
