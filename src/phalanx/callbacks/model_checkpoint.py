"""``ModelCheckpoint``: save the best k checkpoints by a metric, and/or the latest one.

Every rank runs this callback and makes the same decisions (``trainer.callback_metrics`` is
identical on all ranks), so ``trainer.save_checkpoint`` and the removal of checkpoints that drop out
of the top k (collectives: rank 0 writes and deletes, through the strategy) are always called by all
of them together. A checkpoint is a file or, with sharded strategies, a directory.

A run that went non-finite never replaces a good checkpoint: before each save every rank checks its
weights (one collective, so all agree), and a non-finite monitor value never enters the top k.
Either case skips the save with a warning and keeps what is on disk.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from phalanx.callbacks.base import Callback
from phalanx.utils import diagnostics
from phalanx.utils.errors import MisconfigurationError

_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")


class ModelCheckpoint(Callback):
    """Args:
        dirpath: folder for the files (default: ``<log_dir>/checkpoints``).
        filename: template such as ``"{epoch}-{val_loss:.3f}"``; each field becomes ``name=value``.
        monitor: metric in ``trainer.callback_metrics`` ranking the checkpoints (None: keep the latest).
        mode: "min" or "max".
        save_top_k: how many to keep (-1: all, 0: none besides ``last.ckpt``).
        save_last: also write ``last.ckpt`` at every save (what ``fit(ckpt_path="last")`` resumes from).
        every_n_train_steps / every_n_epochs: when to save (default: every epoch).
        save_weights_only: write only the model (such files cannot resume a fit).
    """

    skip_in_fast_dev_run = True  # it checkpoints: fast_dev_run is a smoke test

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool = False,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        save_weights_only: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise MisconfigurationError(f"ModelCheckpoint mode={mode!r}; use 'min' or 'max'.")
        if save_top_k < -1:
            raise MisconfigurationError(f"save_top_k must be >= -1, got {save_top_k}.")
        if every_n_train_steps and every_n_epochs:
            raise MisconfigurationError("Set every_n_train_steps or every_n_epochs, not both.")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and value < 0:
                raise MisconfigurationError(f"{name} must be >= 0, got {value}.")
        self.dirpath: Path | None = Path(dirpath).absolute() if dirpath is not None else None
        self.filename = filename or "epoch={epoch}-step={step}"
        self.monitor, self.mode, self.save_top_k, self.save_last = monitor, mode, save_top_k, save_last
        self.every_n_train_steps = every_n_train_steps or 0
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else (0 if every_n_train_steps else 1)
        self.save_weights_only = save_weights_only
        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._kept: list[str] = []  # files saved without a monitor, oldest first (kept_model_paths)
        self._last_step_saved = -1

    @property
    def state_key(self) -> str:
        return (f"ModelCheckpoint{{monitor={self.monitor!r}, every_n_train_steps={self.every_n_train_steps}, "
                f"every_n_epochs={self.every_n_epochs}}}")

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        if self.dirpath is None and stage == "fit":
            self.dirpath = Path(trainer.log_dir) / "checkpoints"

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        n = self.every_n_train_steps
        if not n:  # the default (save per epoch): nothing to read from the trainer at every batch
            return
        step = trainer.global_step
        if step > 0 and step % n == 0 and step != self._last_step_saved and not trainer.in_window:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        n = self.every_n_epochs
        if n and (trainer.current_epoch + 1) % n == 0 and trainer.global_step != self._last_step_saved:
            self._save(trainer)

    # ------------------------------------------------------------------ saving
    def _save(self, trainer: Any) -> None:
        assert self.dirpath is not None
        self._last_step_saved = trainer.global_step
        if not trainer.fabric.strategy.weights_finite(trainer.model):
            diagnostics.warn(
                f"ModelCheckpoint: the model's weights hold inf/nan at epoch {trainer.current_epoch}, step "
                f"{trainer.global_step}; no checkpoint is written and the existing ones in {self.dirpath} are kept "
                "(the run diverged: lower the learning rate, clip gradients, or check the data).",
                rank=trainer.global_rank,
            )
            return
        if self.monitor is not None:
            self._save_top_k(trainer)
        elif self.save_top_k != 0:
            # Bookkeeping first, so the checkpoint being written already describes itself.
            path = self._new_path(trainer)
            self._kept.append(str(path))
            keep = len(self._kept) if self.save_top_k == -1 else self.save_top_k
            dropped = self._kept[: len(self._kept) - keep]
            self._kept = self._kept[len(dropped):]
            self.best_model_path = str(path)
            trainer.save_checkpoint(path, self.save_weights_only)
            for old in dropped:
                self._remove(trainer, old)
        if self.save_last:
            path = self.dirpath / "last.ckpt"
            trainer.save_checkpoint(path, self.save_weights_only)
            self.last_model_path = str(path)

    def _save_top_k(self, trainer: Any) -> None:
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            raise MisconfigurationError(
                f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric; logged metrics: {sorted(metrics)}. "
                "Log it with self.log(...), or save at a point where it exists (e.g. every_n_epochs when it is a "
                "validation metric)."
            )
        score = float(metrics[self.monitor])
        if self.save_top_k == 0:
            return
        if not math.isfinite(score):
            diagnostics.warn(
                f"ModelCheckpoint: {self.monitor}={score} at epoch {trainer.current_epoch}, step {trainer.global_step} "
                "is not finite, so this checkpoint is not ranked among the best and none is replaced.",
                rank=trainer.global_rank,
            )
            return
        full = self.save_top_k != -1 and len(self.best_k_models) >= self.save_top_k
        if full and not self._better(score, self._worst()[1]):
            return
        path = str(self._new_path(trainer, metrics))
        self.best_k_models[path] = score
        dropped = None
        if self.save_top_k != -1 and len(self.best_k_models) > self.save_top_k:
            dropped = self._worst()[0]
            del self.best_k_models[dropped]
        pick = min if self.mode == "min" else max
        self.best_model_path = pick(self.best_k_models, key=lambda p: self.best_k_models[p])
        self.best_model_score = self.best_k_models[self.best_model_path]
        trainer.save_checkpoint(path, self.save_weights_only)
        if dropped is not None:
            self._remove(trainer, dropped)

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _worst(self) -> tuple[str, float]:
        pick = max if self.mode == "min" else min
        path = pick(self.best_k_models, key=lambda p: self.best_k_models[p])
        return path, self.best_k_models[path]

    def _remove(self, trainer: Any, path: str) -> None:
        if path != self.last_model_path:
            trainer.fabric.remove_checkpoint(path)  # every rank calls; rank 0 deletes file or directory

    def format_filename(self, trainer: Any, metrics: dict[str, Any] | None = None) -> str:
        values: dict[str, Any] = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        values.update({k: float(v) for k, v in (metrics or trainer.callback_metrics).items()})

        def field(match: re.Match[str]) -> str:
            key, fmt = match.group(1), match.group(2) or ""
            if key not in values:
                raise MisconfigurationError(
                    f"ModelCheckpoint filename {self.filename!r} uses {key!r}, which is not logged; available: "
                    f"{sorted(values)}."
                )
            text = format(values[key], fmt[1:]) if fmt else str(values[key])
            # Templates may already spell "name={name}"; do not repeat the name then.
            before = match.string[: match.start()]
            return text if before.endswith(f"{key}=") else f"{key.replace('/', '_')}={text}"

        return _FIELD.sub(field, self.filename)

    def _new_path(self, trainer: Any, metrics: dict[str, Any] | None = None) -> Path:
        assert self.dirpath is not None
        stem = self.format_filename(trainer, metrics)
        path, version = self.dirpath / f"{stem}.ckpt", 1
        while str(path) in self.best_k_models or str(path) in self._kept:
            path, version = self.dirpath / f"{stem}-v{version}.ckpt", version + 1
        return path

    @property
    def kept_model_paths(self) -> list[str]:
        """The files saved without a monitor that are kept (``save_top_k`` of them), oldest first."""
        return list(self._kept)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "dirpath": str(self.dirpath) if self.dirpath is not None else None,
            "best_k_models": dict(self.best_k_models), "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score, "last_model_path": self.last_model_path,
            "kept": list(self._kept), "last_step_saved": self._last_step_saved,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_k_models = dict(state["best_k_models"])
        self.best_model_path, self.best_model_score = state["best_model_path"], state["best_model_score"]
        self.last_model_path, self._kept = state["last_model_path"], list(state["kept"])
        self._last_step_saved = state["last_step_saved"]
