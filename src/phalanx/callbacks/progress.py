"""Progress bars on global rank 0: tqdm (a phalanx dependency) or rich (when installed and asked for).

``ProgressBar`` picks the backend; ``TQDMProgressBar`` and ``RichProgressBar`` are Lightning's names for
each, with the arguments phalanx cannot honour refused.

While a bar is drawn, log records (phalanx's notices, and the application's on the root logger) are written
through the bar's own path, so each starts a line of its own instead of being glued to the bar: tqdm's
``logging_redirect_tqdm`` (``tqdm.write``: clear the bar, write the line, draw the bar again), and rich's
live display, which takes ``sys.stderr`` over while it runs (phalanx's handler writes to the current one)."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TYPE_CHECKING, Any

from phalanx.callbacks.base import Callback
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.module import Module
    from phalanx.core.view import TrainerView


def _console_loggers() -> list[logging.Logger]:
    """The loggers that write to the console themselves: phalanx's (unless the application configured logging)
    and the root logger (when the application gave it a console handler)."""
    found = []
    for logger in (logging.getLogger("phalanx"), logging.getLogger()):
        if any(isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr) for h in logger.handlers):
            found.append(logger)
    return found


class _TqdmBar:
    def __init__(self, total: int | None, desc: str, initial: int, leave: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, initial=initial, leave=leave, dynamic_ncols=True, file=sys.stderr)

    @staticmethod
    def write_logs_through() -> contextlib.AbstractContextManager[Any]:
        """While entered, console log records go through ``tqdm.write``."""
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        redirect: contextlib.AbstractContextManager[Any] = logging_redirect_tqdm(loggers=_console_loggers(),
                                                                                 tqdm_class=tqdm)
        return redirect

    def update(self, n: int, metrics: dict[str, Any]) -> None:
        if metrics:
            self.bar.set_postfix(metrics, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


class _RichBar:
    @staticmethod
    def write_logs_through() -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # rich's live display takes sys.stderr over itself

    def __init__(self, total: int | None, desc: str, initial: int, leave: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"), transient=not leave)
        self.progress.start()
        self.task = self.progress.add_task(desc, total=total, completed=initial, metrics="")

    def update(self, n: int, metrics: dict[str, Any]) -> None:
        shown = " ".join(f"{k}={v}" for k, v in metrics.items())
        self.progress.update(self.task, advance=n, metrics=shown)

    def close(self) -> None:
        self.progress.stop()


def _backend(name: str) -> type[_TqdmBar] | type[_RichBar]:
    if name == "tqdm":
        return _TqdmBar
    try:
        import rich  # noqa: F401
    except ImportError:
        if name == "rich":
            raise MisconfigurationError(
                "ProgressBar(backend='rich') needs the rich package: pip install rich."
            ) from None
        return _TqdmBar
    return _RichBar


class ProgressBar(Callback):
    """Args:
        refresh_rate: update every this many batches (0 disables the bar).
        backend: "tqdm", "rich", or "auto" (rich when installed, else tqdm).
    """

    def __init__(self, refresh_rate: int = 1, backend: str = "auto") -> None:
        if backend not in ("auto", "tqdm", "rich"):
            raise MisconfigurationError(f"ProgressBar backend={backend!r}; use 'auto', 'tqdm' or 'rich'.")
        if refresh_rate < 0:
            raise MisconfigurationError(f"refresh_rate must be >= 0, got {refresh_rate}.")
        self.refresh_rate, self.backend = refresh_rate, backend
        self._bars: dict[str, Any] = {}
        self._pending: dict[str, int] = {}
        self._logs = contextlib.ExitStack()  # records through the bars: from the first bar opened to the last closed

    def _active(self, trainer: TrainerView) -> bool:
        return self.refresh_rate > 0 and trainer.is_global_zero

    @staticmethod
    def _metrics(trainer: TrainerView) -> dict[str, str]:
        return {k: f"{v:.4g}" for k, v in trainer.progress_bar_metrics.items()}

    def _open(self, key: str, total: int | None, desc: str, initial: int = 0, leave: bool = True) -> None:
        self._close(key)
        backend = _backend(self.backend)
        if not self._bars:
            self._logs.enter_context(backend.write_logs_through())
        self._bars[key] = backend(total, desc, initial, leave)
        self._pending[key] = 0

    def _advance(self, trainer: TrainerView, key: str) -> None:
        if key not in self._bars:
            return
        self._pending[key] += 1
        if self._pending[key] >= self.refresh_rate:
            self._bars[key].update(self._pending[key], self._metrics(trainer))
            self._pending[key] = 0

    def _close(self, key: str) -> None:
        bar = self._bars.pop(key, None)
        if bar is not None:
            pending = self._pending.pop(key, 0)
            if pending:
                bar.update(pending, {})
            bar.close()
        if not self._bars:
            self._logs.close()

    def on_train_epoch_start(self, trainer: TrainerView, module: Module) -> None:
        if self._active(trainer):
            total = trainer.num_training_batches
            self._open("train", total, f"Epoch {trainer.current_epoch}", initial=trainer.batches_done)

    def on_train_batch_end(
        self, trainer: TrainerView, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._advance(trainer, "train")

    def on_train_epoch_end(self, trainer: TrainerView, module: Module) -> None:
        bar = self._bars.get("train")
        if bar is not None:
            bar.update(0, self._metrics(trainer))
        self._close("train")

    def _eval_start(self, trainer: TrainerView, key: str) -> None:
        if self._active(trainer):
            totals = trainer.num_eval_batches
            known = [n for n in totals if n is not None]
            total = sum(known) if totals and len(known) == len(totals) else None
            self._open(key, total, key.capitalize(), leave=trainer.stage != "fit")

    def on_validation_epoch_start(self, trainer: TrainerView, module: Module) -> None:
        self._eval_start(trainer, "validation")

    def on_validation_batch_end(
        self, trainer: TrainerView, module: Module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._advance(trainer, "validation")

    def on_validation_epoch_end(self, trainer: TrainerView, module: Module) -> None:
        self._close("validation")

    def on_test_epoch_start(self, trainer: TrainerView, module: Module) -> None:
        self._eval_start(trainer, "test")

    def on_test_batch_end(
        self, trainer: TrainerView, module: Module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._advance(trainer, "test")

    def on_test_epoch_end(self, trainer: TrainerView, module: Module) -> None:
        self._close("test")

    def on_exception(self, trainer: TrainerView, module: Module, exception: BaseException) -> None:
        for key in list(self._bars):
            self._close(key)

    def teardown(self, trainer: TrainerView, module: Module, stage: str) -> None:
        for key in list(self._bars):
            self._close(key)


class TQDMProgressBar(ProgressBar):
    """The tqdm progress bar (rank 0). ``process_position`` must be 0 and ``leave`` False: one bar per
    stage, replaced at each epoch, is what phalanx draws."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        if process_position != 0 or leave:
            raise MisconfigurationError(
                "TQDMProgressBar(process_position=..., leave=True) is not supported; phalanx draws one bar per stage "
                "on rank 0. Remove those arguments."
            )
        super().__init__(refresh_rate=refresh_rate, backend="tqdm")


class RichProgressBar(ProgressBar):
    """The rich progress bar (rank 0; rich must be installed). Themes and console options are refused."""

    def __init__(self, refresh_rate: int = 1, leave: bool = False, theme: Any = None,
                 console_kwargs: dict[str, Any] | None = None) -> None:
        if leave or theme is not None or console_kwargs:
            raise MisconfigurationError(
                "RichProgressBar(leave=/theme=/console_kwargs=) is not supported; remove those arguments."
            )
        super().__init__(refresh_rate=refresh_rate, backend="rich")
