"""``measure_flops`` (torch.utils.flop_counter) and ``ThroughputMonitor`` (rates over a window, logged through
``fabric.log_dict``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from phalanx import Fabric
from phalanx.fabric.throughput import Throughput, ThroughputMonitor, get_available_flops, measure_flops
from phalanx.loggers import Logger

M, K, N = 8, 16, 32  # input (M, K) through Linear(K, N)


def test_flops_of_a_linear_forward() -> None:
    model = nn.Linear(K, N)
    x = torch.randn(M, K)
    assert measure_flops(model, lambda: model(x)) == 2 * M * N * K


def test_flops_with_backward() -> None:
    model = nn.Linear(K, N, bias=False)
    x = torch.randn(M, K, requires_grad=True)
    # forward 2mnk, backward: gradient of the input and of the weight, 2mnk each
    assert measure_flops(model, lambda: model(x), lambda y: y.sum()) == 3 * 2 * M * N * K


def test_flops_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = nn.Linear(K, N)
        x = torch.randn(M, K)
        assert measure_flops(model, lambda: model(x)) == 2 * M * N * K


def test_rates_over_the_window() -> None:
    meter = Throughput(available_flops=100.0, world_size=2, window_size=3)
    # cumulative counters; flops per update. Steps of 2 s, 4 batches of 8 samples of 10 items each.
    for i in range(1, 4):
        assert "device/batches_per_sec" not in meter.compute()  # the window is not full yet
        meter.update(time=2.0 * i, batches=4 * i, samples=32 * i, lengths=320 * i, flops=60.0)
    metrics = meter.compute()
    assert metrics["time"] == 6.0 and metrics["batches"] == 12 and metrics["samples"] == 96
    assert metrics["lengths"] == 960
    assert metrics["device/batches_per_sec"] == pytest.approx(2.0)
    assert metrics["device/samples_per_sec"] == pytest.approx(16.0)
    assert metrics["device/items_per_sec"] == pytest.approx(160.0)
    assert metrics["device/flops_per_sec"] == pytest.approx(30.0)  # 2 updates of 60 over 4 s
    assert metrics["device/mfu"] == pytest.approx(0.3)
    assert metrics["batches_per_sec"] == pytest.approx(4.0)  # world_size 2
    assert metrics["flops_per_sec"] == pytest.approx(60.0)
    # the window slides: a slower stretch shows only in the latest rates
    meter.update(time=16.0, batches=16, samples=128, lengths=1280, flops=60.0)
    assert meter.compute()["device/batches_per_sec"] == pytest.approx(8 / 12)


def test_counters_must_be_running_totals() -> None:
    meter = Throughput(window_size=2)
    meter.update(time=1.0, batches=2, samples=4)
    with pytest.raises(ValueError, match="samples must not decrease"):
        meter.update(time=2.0, batches=3, samples=3)
    with pytest.raises(ValueError, match="at least 2"):
        Throughput(window_size=1)


class Recorder(Logger):
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], Any]] = []

    def log_metrics(self, metrics: dict[str, float], step: Any = None) -> None:
        self.logged.append((metrics, step))


def test_monitor_logs_through_fabric() -> None:
    recorder = Recorder()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=recorder)
    monitor = ThroughputMonitor(fabric, window_size=2)
    assert monitor.world_size == 1 and monitor.available_flops is None  # no peak FLOPs known for a CPU
    monitor.update(time=1.0, batches=1, samples=4)
    monitor.update(time=2.0, batches=2, samples=8)
    metrics = monitor.compute_and_log(step=7)
    assert recorder.logged == [(metrics, 7)]
    assert metrics["device/samples_per_sec"] == pytest.approx(4.0)
    assert "samples_per_sec" not in metrics  # one device: no job-wide copies
    monitor.compute_and_log()
    assert recorder.logged[-1][1] == 8


def test_peak_flops_unknown_off_gpu() -> None:
    assert get_available_flops(torch.device("cpu"), torch.bfloat16) is None
