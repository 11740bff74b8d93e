"""What the loops publish from ``self.log``, identical on every rank: ``trainer.callback_metrics``, the progress
bar's values and the loggers'. Step values reach the host only in batches (see :class:`MetricBoard`)."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.trainer.results import Entry, Results
from phalanx.utils.late_reads import LateRead


class MetricBoard:
    """What the loops publish, identical on every rank: ``callback_metrics`` (step values as device tensors,
    epoch values as CPU tensors), the progress bar's and the loggers' values, and the step values synced since
    the last logger flush. Step values reach the host only in batches: one read per logger flush, and for the
    progress bar a copy in the background that the bar shows once it has arrived (it never waits for it)."""

    def __init__(self) -> None:
        self.callback: dict[str, torch.Tensor] = {}
        self._bar: dict[str, float] = {}
        self._bar_new: dict[str, torch.Tensor] = {}  # published for the bar, not yet on the way to the host
        self._bar_read: tuple[list[str], LateRead] | None = None  # on the way
        self.logged: dict[str, float] = {}
        self.unlogged: dict[str, torch.Tensor] = {}

    @property
    def progress_bar(self) -> dict[str, float]:
        """The newest progress bar values that have arrived on the host (never waits for the device)."""
        for _ in range(2):  # what arrived; then what is new, sent (on a CPU it has arrived at once)
            read = self._bar_read
            if read is not None and read[1].ready():
                self._bar.update(zip(read[0], read[1].values()))
                self._bar_read = read = None
            if read is None and self._bar_new:
                keys, values = list(self._bar_new), list(self._bar_new.values())
                self._bar_new = {}
                self._bar_read = (keys, LateRead(torch.stack([v.to(values[0].device) for v in values])))
        return self._bar

    @staticmethod
    def _keys(entry: Entry, level: str) -> tuple[str, ...]:
        if entry.on_step and entry.on_epoch:
            return (f"{entry.name}_{level}", entry.name)
        return (entry.name,)

    def publish_step(self, values: dict[str, torch.Tensor], results: Results) -> dict[str, torch.Tensor]:
        """Publish synced step values; returns those meant for the loggers (training ones are also kept
        until the loop's next logger flush, see :meth:`flush_step_log`)."""
        to_log: dict[str, torch.Tensor] = {}
        for name, value in values.items():
            entry = results.entries[name]
            keys = self._keys(entry, "step")
            for key in keys:
                self.callback[key] = value
            if entry.prog_bar:
                self._bar_new[keys[0]] = value
            if entry.logger:
                to_log[keys[0]] = value
        if results.stage == "train":
            self.unlogged.update(to_log)
        return to_log

    def flush_step_log(self, fabric: Any, step: int, due: bool, results: Results) -> None:
        """At an optimizer step: send the training step values synced since the last flush to the loggers
        (when ``due``: one read of all of them), then forget them."""
        if due:
            flag = results.names_differ
            values = host_floats({**self.unlogged, **({"": flag} if flag is not None else {})})
            if flag is not None:
                results.check_names(values.pop(""))
            self.log_now(fabric, values, step)
        self.unlogged = {}

    def log_now(self, fabric: Any, values: dict[str, float], step: int) -> None:
        if values:
            self.logged.update(values)
            fabric.log_dict(values, step=step)

    def publish_epoch(
        self, values: dict[str, float], results: Results, fabric: Any, epoch: int, step: int, log: bool = True
    ) -> None:
        to_log: dict[str, float] = {}
        for name, value in values.items():
            entry = results.entries[name]
            keys = self._keys(entry, "epoch")
            for key in keys:
                self.callback[key] = torch.tensor(value, dtype=torch.float64)
            if entry.prog_bar:
                self._bar[keys[0]] = value
            if entry.logger:
                to_log[keys[0]] = value
        if to_log and log:
            to_log["epoch"] = float(epoch)
            self.logged.update(to_log)
            fabric.log_dict(to_log, step=step)

    def restore_point(self) -> tuple[dict[str, Any], ...]:
        """Copies of the published metrics, for :meth:`restore` after a tuning phase or the sanity check."""
        return dict(self.callback), dict(self.progress_bar), dict(self.logged), dict(self.unlogged)

    def restore(self, saved: tuple[dict[str, Any], ...]) -> None:
        self.callback, self._bar, self.logged, self.unlogged = (dict(d) for d in saved)
        self._bar_new, self._bar_read = {}, None


def host_floats(values: dict[str, Any]) -> dict[str, float]:
    """Device values as floats, in one read."""
    if not values:
        return {}
    tensors = [v.detach().reshape(()).to(torch.float64) if isinstance(v, torch.Tensor)
               else torch.tensor(float(v), dtype=torch.float64) for v in values.values()]
    device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
    return dict(zip(values, torch.stack([t.to(device) for t in tensors]).tolist()))


def reads_metrics(hook: Any) -> bool:
    """Whether a callback method may read ``trainer.callback_metrics`` on some ranks only (user code may
    do anything; phalanx's own callbacks read it on every rank or read only the progress bar values)."""
    return not getattr(hook, "__module__", "").startswith("phalanx.callbacks.")
