"""``LoggerConnector``: the Trainer's logged results, and the one place that says how a value logged with
``self.log`` reaches ``trainer.callback_metrics``, the progress bar and the loggers.

The path of a value:

1. ``Module.log`` records it in the :class:`~phalanx.trainer.results.Results` of the stage running now
   (:meth:`LoggerConnector.sink`); recording never communicates.
2. Step values are synced across ranks (:meth:`LoggerConnector.sync_step_metrics`: one all_gather per stage
   that has any) only where something consumes them: at a logger flush, at a progress-bar refresh when a
   logged value goes to the bar, before a hook of the user's callbacks or Module that may read
   ``callback_metrics``, and at epoch end. They are published as device tensors: nothing waits for the host.
3. The host reads step values only in batches: one read per logger flush (every ``log_every_n_steps``
   optimizer steps, training only; evaluation step values are logged per batch), and for the progress bar
   a copy in the background that the bar shows once it has arrived (it never waits for it).
4. At an epoch's end the stage's epoch values are synced (read once) and published to all three;
   ``callback_metrics`` keeps them on the device they were computed on, the one the step values are on.

Published values are identical on every rank. A restore point (:meth:`LoggerConnector.restore_point`) puts
back what was published and which accumulators are in use, so a tuning phase or the sanity check leaves no
trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from phalanx.fabric.fabric import Fabric
from phalanx.trainer.results import LoggedEntry, Results
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.late_reads import LateRead

_STAGES = ("train", "validate", "test")  # the stages that log metrics (each has its Results)


class LoggerConnector:
    """The per-stage :class:`Results` and what the loops publish from them (see the module docstring):
    ``callback_metrics`` (step and epoch values alike as 0-d tensors on the device), the progress bar's and
    the loggers' values, and the training step values synced since the last logger flush."""

    def __init__(self, fabric: Fabric, log_every_n_steps: int) -> None:
        self.fabric = fabric
        self._log_every_n_steps = log_every_n_steps
        self._results: dict[str, Results] = {}
        self.reset_results()
        self._callback: dict[str, torch.Tensor] = {}
        self._bar: dict[str, float] = {}
        self._bar_new: dict[str, torch.Tensor] = {}  # published for the bar, not yet on the way to the host
        self._bar_read: tuple[list[str], LateRead] | None = None  # on the way
        self._logged: dict[str, float] = {}
        self._unlogged: dict[str, torch.Tensor] = {}
        self._bar_rate = 0  # this training epoch's: every how many batches the bar shows new step values
        self._log_every = 0  # this training epoch's logger flush interval (0: no loggers)

    def reset_results(self) -> None:
        """Fresh accumulators for every stage on ``fabric.device`` (after launch, which decides the device, and
        before each fit). A new dict: a restore point taken earlier keeps the old one."""
        self._results = {s: Results(s, self.fabric.device) for s in _STAGES}

    # ------------------------------------------------------------------ what the loops record
    def sink(self, stage: str | None) -> Results:
        """Where ``Module.log`` records while ``stage`` runs; refused outside the loops that log."""
        results = self._results.get(stage) if stage is not None else None
        if results is None:
            raise MisconfigurationError(
                "self.log() was called outside a training/validation/test loop (e.g. in setup, on_fit_start or "
                "predict_step). Log from the *_step methods or the epoch/batch hooks."
            )
        return results

    def start_epoch(self, stage: str, bar_refresh_rate: int = 0, state: dict[str, Any] | None = None,
                    module: Any = None) -> None:
        """``stage``'s epoch begins: its accumulators are emptied, or loaded from ``state`` (a training epoch
        resumed midway; ``module`` holds its logged Metrics). Training: ``bar_refresh_rate`` is every how many
        batches the progress bar shows new step values (0: never)."""
        results = self._results[stage]
        results.reset()
        if state is not None:
            results.load_state_dict(state, module)
        if stage == "train":
            self._bar_rate = bar_refresh_rate
            self._log_every = self._log_every_n_steps if self.fabric.loggers else 0

    def set_batch(self, stage: str, batch: Any) -> None:
        """The batch ``stage`` runs now (the size that weights its epoch means)."""
        self._results[stage].batch = batch

    def set_dataloader(self, stage: str, idx: int, count: int) -> None:
        """An evaluation moves to loader ``idx`` of ``count``: with several, its names get a
        ``/dataloader_idx_N`` suffix."""
        results = self._results[stage]
        results.dataloader_idx = idx
        results.suffix = f"/dataloader_idx_{idx}" if count > 1 else ""

    @contextlib.contextmanager
    def in_epoch_end(self, stage: str) -> Iterator[None]:
        """Around the Module's epoch-end hook: what it logs is epoch-level by definition."""
        results = self._results[stage]
        results.in_epoch_end = True
        try:
            yield
        finally:
            results.in_epoch_end = False

    # ------------------------------------------------------------------ publishing
    def sync_step_metrics(self) -> None:
        """Publish the step values logged since the last sync (one all_gather per stage that has any)."""
        for results in self._results.values():
            if results.pending:
                self._publish_step(results.sync_step(self.fabric), results)

    def train_batch_end(self, batch_idx: int, step: int, stepped: bool) -> None:
        """After training batch ``batch_idx`` (``stepped``: it ended with optimizer step ``step``): sync when the
        loggers or the progress bar take new values; at an optimizer step, send the training step values synced
        since the last flush to the loggers when a flush is due (one read of all of them), else forget them."""
        results = self._results["train"]
        every = self._log_every
        log_due = stepped and every > 0 and step % every == 0
        if log_due or (self._bar_rate and results.pending_prog_bar and (batch_idx + 1) % self._bar_rate == 0):
            self.sync_step_metrics()
        if stepped and (log_due or self._unlogged):
            if log_due:
                flag = results.names_differ
                values = host_floats({**self._unlogged, **({"": flag} if flag is not None else {})})
                if flag is not None:
                    results.check_names(values.pop(""))
                self._log_now(values, step)
            self._unlogged = {}

    def eval_batch_end(self, stage: str, step: int, log: bool) -> None:
        """After an evaluation batch: step values logged in evaluation (rare) are published per batch, and sent
        to the loggers when ``log`` (not in the sanity check)."""
        results = self._results[stage]
        if results.pending:
            values = self._publish_step(results.sync_step(self.fabric), results)
            if log:
                self._log_now(host_floats(values), step)

    def end_epoch(self, stage: str, epoch: int, step: int, log: bool = True) -> dict[str, float]:
        """``stage``'s epoch values, identical on every rank (see :meth:`Results.sync_epoch`), published; sent to
        the loggers when ``log``. Returns them by logged name."""
        results = self._results[stage]
        tensors = results.sync_epoch(self.fabric)
        values = host_floats(tensors)  # one read for all of them, at the epoch's end
        to_log: dict[str, float] = {}
        for name, value in values.items():
            entry = results.entries[name]
            keys = _keys(entry, "epoch")
            for key in keys:
                # Where it was computed, the device the step values are published on too: code that stacks
                # or compares callback_metrics finds one device (the module's), as in Lightning.
                self._callback[key] = tensors[name]
            if entry.prog_bar:
                self._bar[keys[0]] = value
            if entry.logger:
                to_log[keys[0]] = value
        if to_log and log:
            to_log["epoch"] = float(epoch)
            self._logged.update(to_log)
            self.fabric.log_dict(to_log, step=step)
        return values

    def by_dataloader(self, stage: str, values: dict[str, float], count: int) -> list[dict[str, float]]:
        """:meth:`end_epoch`'s ``values`` as ``validate``/``test`` return them: one dict per loader, on_step and
        on_epoch names with their ``_epoch`` suffix."""
        out: list[dict[str, float]] = [{} for _ in range(count)]
        for name, entry in self._results[stage].entries.items():
            if entry.on_epoch:
                out[entry.dataloader_idx][f"{name}_epoch" if entry.on_step else name] = values[name]
        return out

    def _publish_step(self, values: dict[str, torch.Tensor], results: Results) -> dict[str, torch.Tensor]:
        """Publish synced step values; returns those meant for the loggers (training ones are also kept until
        the next logger flush)."""
        to_log: dict[str, torch.Tensor] = {}
        for name, value in values.items():
            entry = results.entries[name]
            keys = _keys(entry, "step")
            for key in keys:
                self._callback[key] = value
            if entry.prog_bar:
                self._bar_new[keys[0]] = value
            if entry.logger:
                to_log[keys[0]] = value
        if results.stage == "train":
            self._unlogged.update(to_log)
        return to_log

    def _log_now(self, values: dict[str, float], step: int) -> None:
        if values:
            self._logged.update(values)
            self.fabric.log_dict(values, step=step)

    # ------------------------------------------------------------------ what the Trainer's properties read
    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """``trainer.callback_metrics``: syncs pending step values first (a collective while any are pending)."""
        self.sync_step_metrics()
        return self._callback

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
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

    @property
    def logged_metrics(self) -> dict[str, float]:
        return self._logged

    # ------------------------------------------------------------------ checkpoints and restore points
    def train_state_dict(self, host: bool) -> dict[str, Any]:
        """The training epoch's accumulators, for a checkpoint (``host``) or a snapshot (see
        :meth:`Results.state_dict`); :meth:`start_epoch` loads them."""
        return self._results["train"].state_dict(host=host)

    def restore_point(self) -> Callable[[], None]:
        """What is published now and the accumulators in use; calling the result puts them back (it may be
        called more than once)."""
        callback, bar = dict(self._callback), dict(self.progress_bar_metrics)
        logged, unlogged = dict(self._logged), dict(self._unlogged)
        results = self._results

        def restore() -> None:
            self._callback, self._bar, self._logged, self._unlogged = dict(callback), dict(bar), dict(logged), \
                dict(unlogged)
            self._bar_new, self._bar_read = {}, None
            self._results = results

        return restore

    @contextlib.contextmanager
    def discarded(self, stage: str) -> Iterator[None]:
        """What ``stage`` logs inside leaves no trace (the sanity check): pending step values are published
        first, then what is published is put back and ``stage``'s accumulators are emptied."""
        self.sync_step_metrics()
        restore = self.restore_point()
        yield
        restore()
        self._results[stage].reset()

    def devices(self) -> set[torch.device]:
        """Where every stage's accumulators live (a test hook: always ``{fabric.device}``)."""
        return {d for results in self._results.values() for d in results.devices()}


def _keys(entry: LoggedEntry, level: str) -> tuple[str, ...]:
    if entry.on_step and entry.on_epoch:
        return (f"{entry.name}_{level}", entry.name)
    return (entry.name,)


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
