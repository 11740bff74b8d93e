"""``trainer.callback_metrics`` on one device, the module's, as Lightning keeps them: step values and epoch values
alike, after the LR finder, after a plain fit and after ``validate``, with no host read added.

On a GPU, epoch values used to be published as CPU tensors next to step values on ``cuda:0``, so
``torch.stack(list(trainer.callback_metrics.values()))`` failed with a device mismatch. On a CPU every device is the
CPU, so the connector is also driven on the meta device, which stands in for an accelerator: a value put anywhere
but where it was computed shows there."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from host_reads import HostReads
from metric_models import Classifier, loader
from run_if import run_if
from trainer_support import quiet

import phalanx
from phalanx.callbacks import LearningRateFinder
from phalanx.trainer import logger_connector
from phalanx.trainer.logger_connector import LoggerConnector
from phalanx.utils.late_reads import DEFER_VARIABLE

META = torch.device("meta")


class OnMeta:
    """The part of a one-process Fabric the connector uses, on the meta device."""

    world_size = 1
    device = META
    strategy = phalanx.strategies.SingleDeviceStrategy()
    loggers: list[Any] = []

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def log_dict(self, values: dict[str, float], step: int) -> None:
        pass


def test_every_published_value_stays_on_the_device_it_was_computed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # The meta device holds no values: the one batched host read returns zeros; the rest runs as on a GPU.
    monkeypatch.setattr(logger_connector, "host_floats", lambda values: dict.fromkeys(values, 0.0))
    connector = LoggerConnector(OnMeta(), 1)  # type: ignore[arg-type]
    options: dict[str, Any] = {"prog_bar": True, "logger": True, "sync_dist": True, "reduce_fx": "mean",
                               "batch_size": None}
    connector.start_epoch("train")
    for step in range(3):
        connector.set_batch("train", torch.zeros(4, 2, device=META))
        train = connector.sink("train")
        train.log("loss", torch.ones((), device=META), on_step=True, on_epoch=True, **options)
        train.log("lr", 0.1, on_step=True, on_epoch=False, **options)  # a Python number
        train.log("seen", 4, on_step=False, on_epoch=True, **{**options, "reduce_fx": "sum"})
        train.log("peak", torch.ones((), device=META), on_step=False, on_epoch=True, **{**options, "reduce_fx": "max"})
        connector.train_batch_end(step, step + 1, stepped=True)
    connector.sync_step_metrics()
    assert {v.device for v in connector.callback_metrics.values()} == {META}
    assert connector.end_epoch("train", epoch=0, step=3) == {"loss": 0.0, "seen": 0.0, "peak": 0.0}
    connector.start_epoch("validate")
    connector.set_batch("validate", torch.zeros(4, 2, device=META))
    connector.sink("validate").log("val_loss", torch.ones((), device=META), on_step=None, on_epoch=None, **options)
    connector.end_epoch("validate", epoch=0, step=3)
    published = connector.callback_metrics
    assert set(published) == {"loss_step", "loss_epoch", "loss", "lr", "seen", "peak", "val_loss"}
    assert {name: v.device for name, v in published.items()} == dict.fromkeys(published, META)
    assert torch.stack(list(published.values())).device == META


def _fit_and_validate(finder: bool, accelerator: str = "cpu") -> tuple[phalanx.Trainer, Classifier]:
    phalanx.seed_everything(0, verbose=False)
    module = Classifier(style="object", lr=0.05)
    callbacks = [LearningRateFinder(num_training_steps=20, probe=False)] if finder else []
    trainer = phalanx.Trainer(max_epochs=2, callbacks=callbacks, **quiet(accelerator=accelerator))
    trainer.fit(module, loader(64, 8, shuffle=True), loader(32, 16))
    return trainer, module


def _assert_on_the_modules_device(trainer: phalanx.Trainer, module: Classifier) -> None:
    metrics = trainer.callback_metrics
    # Step values (train_loss_step, train_acc_step), epoch values (train_loss_epoch, the validation means) and
    # the epoch values of Metrics (train_acc_epoch, val_acc, the MetricCollection's).
    assert {"train_loss_step", "train_loss_epoch", "train_acc_step", "train_acc_epoch", "val_acc", "val_f1",
            "val_recall", "val_seen"} <= set(metrics)
    device = next(module.parameters()).device
    assert device == trainer.strategy.root_device
    assert {name: v.device for name, v in metrics.items()} == dict.fromkeys(metrics, device)
    stacked = torch.stack(list(metrics.values()))  # what failed with a device mismatch on a GPU
    assert bool(torch.isfinite(stacked).all())


@pytest.mark.parametrize("defer", [False, True], ids=["read-at-once", "read-late"])
@pytest.mark.parametrize("finder", [True, False], ids=["after-the-finder", "plain-fit"])
def test_callback_metrics_live_on_the_modules_device(monkeypatch: pytest.MonkeyPatch, finder: bool,
                                                     defer: bool) -> None:
    monkeypatch.setenv(DEFER_VARIABLE, "1" if defer else "0")
    trainer, module = _fit_and_validate(finder)
    _assert_on_the_modules_device(trainer, module)
    trainer.validate(module, loader(32, 16), verbose=False)
    _assert_on_the_modules_device(trainer, module)


def test_an_epoch_end_reads_its_values_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishing epoch values where they were computed costs no read: each epoch's end reads all its values in
    one batch (two training epochs, two validations), and nothing else in the connector or the results reads."""
    monkeypatch.setenv(DEFER_VARIABLE, "1")
    counter = HostReads()
    counter.active = True
    with counter:
        _fit_and_validate(finder=False)
    reads = {where: count for where, count in counter.reads.items()
             if where.startswith(("trainer/logger_connector.py", "trainer/results.py"))}
    assert reads == {f"trainer/logger_connector.py:{_line('return dict(zip(values, torch.stack(')} (tolist)": 4}


def _line(text: str) -> int:
    source = logger_connector.__file__
    with open(source) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


@pytest.mark.gpu
@run_if(cuda=True)
@pytest.mark.parametrize("finder", [True, False], ids=["after-the-finder", "plain-fit"])
def test_callback_metrics_live_on_the_gpu_with_the_module(finder: bool) -> None:
    trainer, module = _fit_and_validate(finder, accelerator="cuda")
    assert next(module.parameters()).device.type == "cuda"
    _assert_on_the_modules_device(trainer, module)
