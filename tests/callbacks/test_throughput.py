"""The Trainer's ThroughputMonitor: totals count whole optimizer steps, rates appear once the window is
full, FLOPs come from the module's ``flops_per_batch``, and only a fit is measured."""

from __future__ import annotations

import pytest
from trainer_support import Regressor, loader, quiet

import phalanx
from phalanx.callbacks import ThroughputMonitor
from phalanx.loggers import Logger
from phalanx.utils.errors import MisconfigurationError


class Recorder(Logger):
    """A logger that keeps what it was sent."""

    def __init__(self) -> None:
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


def test_throughput_counts_whole_steps_and_logs_rates_and_flops() -> None:
    recorder = Recorder()
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), length_fn=lambda b: 3 * b[0].size(0),
                                window_size=2)
    model = Regressor()
    model.flops_per_batch = 1000  # type: ignore[assignment]
    trainer = phalanx.Trainer(max_epochs=1, accumulate_grad_batches=2, log_every_n_steps=1, callbacks=[monitor],
                              **quiet(logger=recorder))
    trainer.fit(model, loader(24, 4))  # 6 batches of 4: 3 optimizer steps
    rows = [(step, m) for step, m in recorder.rows if any(k.startswith("train/") for k in m)]
    assert [step for step, _ in rows] == [1, 2, 3]
    for step, metrics in rows:
        assert metrics["train/batches"] == 2 * step and metrics["train/samples"] == 8 * step
        assert metrics["train/lengths"] == 24 * step
    first, later = rows[0][1], rows[1:]
    assert "train/device/samples_per_sec" not in first  # one update: no rate yet
    for _, metrics in later:
        rate = metrics["train/device/samples_per_sec"]
        assert rate > 0
        # 2 batches (8 samples, 2000 FLOPs) per update: the rates keep those ratios exactly.
        assert metrics["train/device/flops_per_sec"] == pytest.approx(rate * 250, rel=1e-9)
        assert metrics["train/device/items_per_sec"] == pytest.approx(rate * 3, rel=1e-9)
        assert metrics["train/device/batches_per_sec"] == pytest.approx(rate / 4, rel=1e-9)


def test_throughput_monitor_measures_fit_only_and_checks_its_argument() -> None:
    recorder = Recorder()
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0))
    trainer = phalanx.Trainer(max_epochs=1, callbacks=[monitor], **quiet(logger=recorder))
    trainer.validate(Regressor(), loader(8, 4))
    assert monitor.throughput is None and not any("train/" in k for _, m in recorder.rows for k in m)
    with pytest.raises(MisconfigurationError, match="batch_size_fn"):
        ThroughputMonitor(batch_size_fn=None)  # type: ignore[arg-type]


