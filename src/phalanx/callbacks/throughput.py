"""``ThroughputMonitor``: batches, samples, items and FLOPs per second of a Trainer's fit (Lightning's name).

The arithmetic is :class:`phalanx.fabric.throughput.Throughput`'s (one implementation for Fabric loops
and the Trainer); this callback only feeds it from the training loop. What users get wrong by hand is
the clock: it is read after each *optimizer-step window* on every rank, so a rate covers whole steps,
and on a GPU the device is synchronised first (otherwise it times kernel launches, not work).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from phalanx.callbacks.base import Callback
from phalanx.fabric.throughput import Throughput, peak_flops
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.core.module import Module
    from phalanx.core.view import TrainerView


class ThroughputMonitor(Callback):
    """Logs ``device/batches_per_sec``, ``device/samples_per_sec`` (``items_per_sec`` with ``length_fn``,
    ``flops_per_sec`` and ``mfu`` where the module sets ``flops_per_batch``) every ``log_every_n_steps``.

    Args:
        batch_size_fn: the number of samples in a batch (e.g. ``lambda batch: batch[0].size(0)``).
        length_fn: the number of items (e.g. tokens) in a batch; optional.
        window_size, separator: as :class:`~phalanx.fabric.throughput.Throughput`.
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int],
        length_fn: Callable[[Any], int] | None = None,
        window_size: int = 100,
        separator: str = "/",
    ) -> None:
        if not callable(batch_size_fn):
            raise MisconfigurationError("ThroughputMonitor(batch_size_fn=...) must be a function batch -> samples.")
        self.batch_size_fn, self.length_fn = batch_size_fn, length_fn
        self.window_size, self.separator = window_size, separator
        self.throughput: Throughput | None = None
        self._start = 0.0
        self._batches = self._samples = self._lengths = 0
        self._flops = 0.0

    def setup(self, trainer: TrainerView, module: Module, stage: str) -> None:
        if stage != "fit":
            return
        fabric = trainer.fabric
        self.throughput = Throughput(
            available_flops=peak_flops(fabric),
            world_size=trainer.world_size, window_size=self.window_size, separator=self.separator,
        )

    def _now(self, trainer: TrainerView) -> float:
        if trainer.fabric.device.type == "cuda":
            torch.cuda.synchronize(trainer.fabric.device)
        return time.perf_counter()

    def on_train_start(self, trainer: TrainerView, module: Module) -> None:
        if self.throughput is not None:
            self.throughput.reset()
        self._batches = self._samples = self._lengths = 0
        self._flops = 0.0
        self._start = self._now(trainer)

    def on_train_batch_end(self, trainer: TrainerView, module: Module, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.throughput is None:
            return
        self._batches += 1
        self._samples += int(self.batch_size_fn(batch))
        if self.length_fn is not None:
            self._lengths += int(self.length_fn(batch))
        flops_per_batch = getattr(module, "flops_per_batch", None)
        if flops_per_batch is not None:
            self._flops += float(flops_per_batch)
        if trainer.in_window:
            return  # mid accumulation window: rates cover whole optimizer steps
        self.throughput.update(
            time=self._now(trainer) - self._start, batches=self._batches, samples=self._samples,
            lengths=self._lengths if self.length_fn is not None else None,
            flops=self._flops if flops_per_batch is not None else None,
        )
        self._flops = 0.0
        step = trainer.global_step
        if trainer.log_every_n_steps and step % trainer.log_every_n_steps == 0:
            metrics = self.throughput.compute()
            if metrics:
                trainer.fabric.log_dict({f"train{self.separator}{k}": v for k, v in metrics.items()}, step=step)
