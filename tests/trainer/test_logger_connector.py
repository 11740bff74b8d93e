"""``LoggerConnector``: how a logged value reaches callback_metrics, the progress bar and the loggers, the logger
flush interval, the names check across ranks, and restore points that leave no trace."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import phalanx
from phalanx.trainer.logger_connector import LoggerConnector
from phalanx.utils.errors import MisconfigurationError


class OneRank:
    """The part of a Fabric the connector uses, in one process, with a logger that keeps what it gets."""

    world_size = 1
    device = torch.device("cpu")
    strategy = phalanx.strategies.SingleDeviceStrategy()

    def __init__(self) -> None:
        self.loggers: list[Any] = [object()]
        self.logged: list[tuple[int, dict[str, float]]] = []

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def log_dict(self, values: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(values)))


class TwoRanks(OneRank):
    """Two ranks whose logged names differ (the other rank's name checksum is off by one)."""

    world_size = 2
    strategy = phalanx.strategies.DDPStrategy()

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        other = t.clone()
        other[-1] += 1
        return torch.stack([t, other])


def _log(connector: LoggerConnector, stage: str, name: str, value: float, **options: Any) -> None:
    kwargs: dict[str, Any] = {"on_step": None, "on_epoch": None, "prog_bar": False, "logger": True,
                              "sync_dist": False, "reduce_fx": "mean", "batch_size": 2, **options}
    connector.sink(stage).log(name, torch.tensor(value), **kwargs)


def _training(fabric: OneRank, log_every: int = 2, bar: int = 0) -> LoggerConnector:
    connector = LoggerConnector(fabric, log_every)  # type: ignore[arg-type]
    connector.start_epoch("train", bar_refresh_rate=bar)
    connector.set_batch("train", torch.zeros(2, 3))
    return connector


def test_a_step_value_reaches_callback_metrics_the_bar_and_the_loggers_at_a_flush() -> None:
    fabric = OneRank()
    connector = _training(fabric, log_every=2, bar=1)
    _log(connector, "train", "loss", 3.0, on_step=True, on_epoch=True, prog_bar=True)
    connector.train_batch_end(0, step=1, stepped=True)  # the bar refreshes every batch: synced, not logged
    assert float(connector.callback_metrics["loss_step"]) == float(connector.callback_metrics["loss"]) == 3.0
    assert connector.progress_bar_metrics == {"loss_step": 3.0}
    assert fabric.logged == [] and connector.logged_metrics == {}
    _log(connector, "train", "loss", 5.0, on_step=True, on_epoch=True, prog_bar=True)
    connector.train_batch_end(1, step=2, stepped=True)  # step 2 of every 2: one read, the newest value
    assert fabric.logged == [(2, {"loss_step": 5.0})]
    assert connector.end_epoch("train", epoch=0, step=2) == {"loss": 4.0}
    assert fabric.logged[-1] == (2, {"loss_epoch": 4.0, "epoch": 0.0})
    assert connector.logged_metrics == {"loss_step": 5.0, "loss_epoch": 4.0, "epoch": 0.0}
    assert float(connector.callback_metrics["loss"]) == float(connector.callback_metrics["loss_epoch"]) == 4.0
    assert connector.progress_bar_metrics == {"loss_step": 5.0, "loss_epoch": 4.0}


def test_step_values_between_flushes_are_not_logged_and_nothing_is_without_loggers() -> None:
    fabric = OneRank()
    connector = _training(fabric, log_every=3)
    for step in (1, 2, 3):
        _log(connector, "train", "a", float(step), on_step=True, on_epoch=False)
        connector.sync_step_metrics()  # as before a user hook that may read callback_metrics
        connector.train_batch_end(step - 1, step=step, stepped=True)
    assert fabric.logged == [(3, {"a": 3.0})]
    fabric.loggers = []
    connector.start_epoch("train")
    for step in (4, 5, 6):
        _log(connector, "train", "a", float(step), on_step=True, on_epoch=False)
        connector.train_batch_end(step - 1, step=step, stepped=True)
    assert fabric.logged == [(3, {"a": 3.0})]
    assert float(connector.callback_metrics["a"]) == 6.0  # still published where read


def test_ranks_logging_different_names_are_told_so() -> None:
    # A step sync reads nothing on the host: the check is read with the values, at the next logger flush (or
    # the epoch's end), before anything is logged.
    fabric = TwoRanks()
    connector = _training(fabric, log_every=2)
    _log(connector, "train", "a", 1.0, on_step=True, on_epoch=False, sync_dist=True)
    connector.sync_step_metrics()
    connector.train_batch_end(0, step=1, stepped=True)  # not due: nothing read yet
    _log(connector, "train", "a", 2.0, on_step=True, on_epoch=False, sync_dist=True)
    with pytest.raises(MisconfigurationError, match=r"Ranks logged different step metrics"):
        connector.train_batch_end(1, step=2, stepped=True)
    assert fabric.logged == []


def test_logging_outside_the_loops_that_log_is_refused() -> None:
    connector = LoggerConnector(OneRank(), 1)  # type: ignore[arg-type]
    for stage in (None, "predict"):
        with pytest.raises(MisconfigurationError, match="outside a training/validation/test loop"):
            connector.sink(stage)


def test_evaluation_values_are_per_loader_and_epoch_end_hooks_log_epoch_values() -> None:
    fabric = OneRank()
    connector = LoggerConnector(fabric, 1)  # type: ignore[arg-type]
    connector.start_epoch("validate")
    for idx in (0, 1):
        connector.set_dataloader("validate", idx, 2)
        connector.set_batch("validate", torch.zeros(2))
        _log(connector, "validate", "acc", 0.5 + idx)
        connector.eval_batch_end("validate", step=7, log=True)
    with connector.in_epoch_end("validate"):
        _log(connector, "validate", "score", 9.0, on_step=True)  # epoch-level inside the hook
    values = connector.end_epoch("validate", epoch=1, step=7)
    assert connector.by_dataloader("validate", values, 2) == [
        {"acc/dataloader_idx_0": 0.5}, {"acc/dataloader_idx_1": 1.5, "score/dataloader_idx_1": 9.0}]
    assert fabric.logged == [(7, {"acc/dataloader_idx_0": 0.5, "acc/dataloader_idx_1": 1.5,
                                  "score/dataloader_idx_1": 9.0, "epoch": 1.0})]


def test_a_restore_point_and_a_discarded_stage_leave_no_trace() -> None:
    fabric = OneRank()
    connector = _training(fabric, log_every=1, bar=1)
    _log(connector, "train", "loss", 2.0, on_step=True, on_epoch=True, prog_bar=True)
    connector.train_batch_end(0, step=1, stepped=True)
    _log(connector, "train", "loss", 4.0, on_step=True, on_epoch=True, prog_bar=True)  # pending, and in the epoch

    def published() -> Any:
        return ({k: float(v) for k, v in connector.callback_metrics.items()}, dict(connector.progress_bar_metrics),
                dict(connector.logged_metrics), connector.train_state_dict(host=True))

    before = published()
    restore = connector.restore_point()
    connector.reset_results()  # a tuning phase runs on fresh accumulators
    connector.start_epoch("train", bar_refresh_rate=1)
    connector.set_batch("train", torch.zeros(2, 3))
    _log(connector, "train", "loss", 100.0, on_step=True, on_epoch=True, prog_bar=True)
    connector.train_batch_end(0, step=9, stepped=True)
    connector.end_epoch("train", epoch=5, step=9)
    restore()
    after = published()
    assert after[:3] == before[:3]
    assert after[3]["loss"]["values"].tolist() == before[3]["loss"]["values"].tolist() == [2.0, 4.0]

    logged = list(fabric.logged)
    with connector.discarded("validate"):  # the sanity check
        connector.start_epoch("validate")
        connector.set_batch("validate", torch.zeros(2))
        _log(connector, "validate", "val", 1.0)
        connector.end_epoch("validate", epoch=0, step=1, log=False)
    assert published()[:3] == after[:3] and fabric.logged == logged
    assert connector.end_epoch("validate", epoch=0, step=1) == {}
