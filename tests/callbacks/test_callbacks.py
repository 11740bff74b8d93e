"""Callbacks against a fake trainer: top-k bookkeeping, filenames, early stopping rules, the LR
monitor's names and the progress bar's life cycle (rank 0 only)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_trainer import FakeTrainer, end_epoch
from run_if import run_if
from trainer_support import Regressor, loader

import phalanx
from phalanx.callbacks import (
    BatchSizeFinder,
    Callback,
    EarlyStopping,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
    ProgressBar,
)
from phalanx.trainer.checkpoint_connector import callback_keys
from phalanx.utils.errors import MisconfigurationError, PhalanxWarning


def test_model_checkpoint_keeps_the_best_k_and_deletes_the_rest(tmp_path: Path) -> None:
    trainer = FakeTrainer(tmp_path)
    cb = ModelCheckpoint(filename="{epoch}-{val_loss:.2f}", monitor="val_loss", save_top_k=2, save_last=True)
    cb.setup(trainer, None, "fit")
    assert cb.dirpath == tmp_path / "checkpoints"
    for loss in (0.9, 0.5, 0.7, 0.8, 0.4):
        end_epoch(cb, trainer, loss)
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert files == ["epoch=1-val_loss=0.50.ckpt", "epoch=4-val_loss=0.40.ckpt", "last.ckpt"]
    assert Path(cb.best_model_path).name == "epoch=4-val_loss=0.40.ckpt" and cb.best_model_score == pytest.approx(0.4)
    # 0.8 was never written (worse than both kept); last.ckpt was written at every save.
    assert "epoch=3-val_loss=0.80.ckpt" not in trainer.saved and trainer.saved.count("last.ckpt") == 5
    restored = ModelCheckpoint(filename="{epoch}-{val_loss:.2f}", monitor="val_loss", save_top_k=2)
    restored.load_state_dict(cb.state_dict())
    assert restored.best_k_models == cb.best_k_models


def test_model_checkpoint_every_n_steps_without_monitor_and_on_other_ranks(tmp_path: Path) -> None:
    for rank in (0, 1):
        trainer = FakeTrainer(tmp_path / f"r{rank}", rank=rank)
        cb = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=1)
        for step in range(1, 8):
            trainer.global_step = step
            trainer.in_window = step == 6  # a non-boundary batch never saves
            cb.on_train_batch_end(trainer, None, None, None, step)
        assert trainer.saved == ["epoch=0-step=3.ckpt"]  # step 6 was inside a window
        cb.on_train_epoch_end(trainer, None)  # every_n_epochs is off when every_n_train_steps is set
        assert trainer.saved == ["epoch=0-step=3.ckpt"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["epoch=0-step=3.ckpt"]  # written by rank 0 only


def test_model_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationError, match=r"not both"):
        ModelCheckpoint(every_n_train_steps=2, every_n_epochs=1)
    with pytest.raises(MisconfigurationError, match=r"mode='best'"):
        ModelCheckpoint(mode="best")
    trainer = FakeTrainer(tmp_path)
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_acc")
    trainer.callback_metrics["train_loss"] = torch.tensor(1.0)
    with pytest.raises(MisconfigurationError, match=r"no such metric; logged metrics: \['train_loss'\]"):
        end_epoch(cb, trainer)
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{nope}")
    with pytest.raises(MisconfigurationError, match=r"uses 'nope', which is not logged"):
        end_epoch(cb, trainer)


def test_early_stopping_rules(tmp_path: Path) -> None:
    trainer = FakeTrainer(tmp_path)
    cb = EarlyStopping("val_loss", patience=2, min_delta=0.05)
    for loss in (1.0, 0.9, 0.88, 0.87):
        end_epoch(cb, trainer, loss)
    assert trainer.should_stop and cb.stopped_epoch == 3 and cb.best_score == pytest.approx(0.9)
    assert cb.state_dict()["wait_count"] == 2
    assert EarlyStopping("m", mode="max", stopping_threshold=0.9).evaluate(0.95)[0]
    assert EarlyStopping("m", divergence_threshold=10.0).evaluate(11.0)[0]
    assert EarlyStopping("m").evaluate(float("nan")) == (True, "m = nan is not finite.")
    lenient = EarlyStopping("missing", strict=False)
    trainer = FakeTrainer(tmp_path)
    with pytest.warns(PhalanxWarning, match=r"EarlyStopping: 'missing' is not logged yet, so it is not checked"):
        lenient.on_train_epoch_end(trainer, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lenient.on_train_epoch_end(trainer, None)  # said once
        EarlyStopping("missing", strict=False).on_train_epoch_end(FakeTrainer(tmp_path, rank=1), None)  # rank 0 says it
    assert not trainer.should_stop
    with pytest.raises(MisconfigurationError, match=r"found no such metric"):
        EarlyStopping("missing").on_train_epoch_end(FakeTrainer(tmp_path), None)


def test_learning_rate_monitor_names_and_interval(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.2}])
    trainer = FakeTrainer(tmp_path)
    trainer.optimizer = opt
    cb = LearningRateMonitor(log_momentum=True)
    cb.setup(trainer, None, "fit")
    for step in (1, 1, 2):
        trainer.global_step = step
        cb.on_train_batch_end(trainer, None, None, None, 0)
    assert [s for _, s in trainer.fabric.logged] == [1, 2]
    assert trainer.fabric.logged[0][0] == {"lr-AdamW/pg0": 0.1, "lr-AdamW/pg1": 0.2, "momentum-AdamW/pg0": 0.9,
                                           "momentum-AdamW/pg1": 0.9}
    trainer.loggers = []
    with pytest.raises(MisconfigurationError, match=r"needs a logger"):
        cb.setup(trainer, None, "fit")


def test_progress_bar_only_on_rank_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for rank in (0, 1):
        trainer = FakeTrainer(tmp_path, rank=rank)
        bar = ProgressBar(backend="tqdm")
        bar.on_train_epoch_start(trainer, None)
        for i in range(5):
            trainer.progress_bar_metrics["loss"] = 1.0 / (i + 1)
            bar.on_train_batch_end(trainer, None, None, None, i)
        bar.on_validation_epoch_start(trainer, None)
        bar.on_validation_batch_end(trainer, None, None, None, 0)
        bar.on_validation_epoch_end(trainer, None)
        bar.on_train_epoch_end(trainer, None)
        err = capsys.readouterr().err
        if rank == 0:
            assert "Epoch 0" in err and "5/5" in err and "loss=0.2" in err
        else:
            assert err == ""
    with pytest.raises(MisconfigurationError, match=r"backend='fancy'"):
        ProgressBar(backend="fancy")


@run_if(module="rich")
def test_rich_progress_bar_when_installed(tmp_path: Path) -> None:
    trainer = FakeTrainer(tmp_path)
    bar = ProgressBar(backend="rich")
    bar.on_train_epoch_start(trainer, None)
    trainer.progress_bar_metrics["loss"] = 0.25
    bar.on_train_batch_end(trainer, None, None, None, 0)
    bar.on_train_batch_end(trainer, None, None, None, 1)
    progress = bar._bars["train"].progress
    task = progress.tasks[0]
    assert (task.description, task.total, task.completed, task.fields["metrics"]) == ("Epoch 0", 5, 2, "loss=0.25")
    assert progress.live.is_started
    bar.on_train_epoch_end(trainer, None)
    assert not bar._bars and not progress.live.is_started  # closed with its epoch


def test_callback_state_keys_are_unique() -> None:
    class Plain:
        def state_dict(self) -> dict[str, Any]:
            return {}

    keys = [k for k, _ in callback_keys([Plain(), Plain(), EarlyStopping("a"), EarlyStopping("b"), object()])]
    assert keys == ["test_callback_state_keys_are_unique.<locals>.Plain",
                    "test_callback_state_keys_are_unique.<locals>.Plain#1",
                    "EarlyStopping{monitor='a', mode='min'}", "EarlyStopping{monitor='b', mode='min'}"]


def test_csv_logger_appends_and_grows_its_header(tmp_path: Path) -> None:
    """A flush appends its rows (O(rows since the last flush)); only a new metric name rewrites the
    file, so that the header names every column."""
    from phalanx.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="exp", flush_every=2)
    for step in range(4):
        logger.log_metrics({"loss": float(step)}, step=step)
    path = logger.metrics_file
    inode = path.stat().st_ino
    for step in range(4, 6):
        logger.log_metrics({"loss": float(step)}, step=step)
    assert path.stat().st_ino == inode  # appended to, not rewritten
    logger.log_metrics({"loss": 6.0, "val_acc": 0.5}, step=6)
    logger.finalize()
    assert path.stat().st_ino != inode  # a new column: rewritten once, atomically
    lines = path.read_text().splitlines()
    assert lines[0] == "step,loss,val_acc"
    assert lines[1:] == [f"{s},{float(s)}," for s in range(6)] + ["6,6.0,0.5"]
    resumed = CSVLogger(tmp_path, name="exp", version=0)  # a later run writing to the same file keeps it
    resumed.log_metrics({"loss": 7.0}, step=7)
    resumed.save()
    assert path.read_text().splitlines() == [*lines, "7,7.0,"]


def test_callbacks_that_checkpoint_stop_or_tune_sit_out_fast_dev_run(tmp_path: Path) -> None:
    """Each such callback says so itself (``skip_in_fast_dev_run``); the Trainer does not list their types."""
    assert all(cls.skip_in_fast_dev_run for cls in (ModelCheckpoint, EarlyStopping, LearningRateFinder,
                                                       BatchSizeFinder))
    assert not Callback.skip_in_fast_dev_run and not ProgressBar.skip_in_fast_dev_run

    class Counts:  # not a Callback subclass: the attribute alone decides
        def __init__(self, skip: bool) -> None:
            self.skip_in_fast_dev_run = skip
            self.calls = 0

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            self.calls += 1

    skipped, called = Counts(True), Counts(False)
    trainer = phalanx.Trainer(fast_dev_run=True, default_root_dir=tmp_path, accelerator="cpu",
                              enable_progress_bar=False, enable_model_summary=False, callbacks=[skipped, called])
    trainer.fit(Regressor(scheduler=False), loader(8, 4))
    assert (skipped.calls, called.calls) == (0, 1)


def test_gradient_accumulation_scheduler_supplies_the_schedule_the_loop_reads() -> None:
    """Epoch 0 steps every batch, epoch 1 every 2 (8 batches per epoch): 8 + 4 optimizer steps."""
    from trainer_support import quiet

    from phalanx.callbacks import GradientAccumulationScheduler, LambdaCallback

    seen: list[tuple[int, int]] = []
    record = LambdaCallback(on_train_epoch_start=lambda t, m: seen.append((t.current_epoch, t.accumulate_grad_batches)))
    scheduler = GradientAccumulationScheduler({1: 2})
    assert scheduler.scheduling == {0: 1, 1: 2} and scheduler.going_to_accumulate_grad_batches(5) == 2
    trainer = phalanx.Trainer(max_epochs=2, callbacks=[scheduler, record], **quiet())
    trainer.fit(Regressor(scheduler=False), loader(16, 2))
    assert seen == [(0, 1), (1, 2)] and trainer.global_step == 12
    assert trainer.settings.accumulate_grad_batches == 1  # the frozen settings are untouched
    with pytest.raises(MisconfigurationError, match="not also to the Trainer"):
        phalanx.Trainer(accumulate_grad_batches=2, callbacks=[GradientAccumulationScheduler({0: 2})], **quiet())
    with pytest.raises(MisconfigurationError, match="Two callbacks supply"):
        phalanx.Trainer(callbacks=[GradientAccumulationScheduler({0: 2}), GradientAccumulationScheduler({1: 2})],
                        **quiet())
    with pytest.raises(MisconfigurationError, match="keys are epochs >= 0"):
        GradientAccumulationScheduler({-1: 2})
