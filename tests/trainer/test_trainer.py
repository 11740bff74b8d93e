"""Single-process Trainer behaviour: logging semantics, optimizer configs, loop limits, evaluation,
data sharding helpers and every misconfiguration error."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset
from trainer_support import CountingSGD, Regressor, dataset, flat, loader, quiet

import phalanx
from phalanx.callbacks import ModelCheckpoint
from phalanx.errors import PhalanxWarning
from phalanx.loggers import Logger
from phalanx.trainer.loaders import EvalBatchSampler, TrainSampler
from phalanx.trainer.loops import windows
from phalanx.utils.errors import MisconfigurationError


class FakeLogger(Logger):
    def __init__(self) -> None:
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


class Logging(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("both", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("n", float(len(x)), on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("biggest", x.abs().max(), on_epoch=True, on_step=False, reduce_fx=torch.max)
        return loss


def test_epoch_means_are_weighted_by_batch_size_and_keys_follow_lightning() -> None:
    logger = FakeLogger()
    trainer = phalanx.Trainer(max_epochs=1, log_every_n_steps=2, **quiet(logger=logger))
    model = Logging(scheduler=False, lr=0.0)  # lr 0: the loss per sample is fixed, so we can recompute it
    trainer.fit(model, loader(10, 4))  # batches of 4, 4, 2
    x, y = dataset(10).tensors
    with torch.no_grad():
        exact = float(torch.nn.functional.mse_loss(model(x), y))
    m = trainer.callback_metrics
    assert float(m["both_epoch"]) == pytest.approx(exact, rel=1e-12)  # not the mean of 3 batch means
    assert float(m["both"]) == float(m["both_epoch"])
    assert float(m["n"]) == 10 and float(m["biggest"]) == float(x.abs().max())
    assert set(trainer.progress_bar_metrics) == {"both_step", "both_epoch"}
    step_rows = [step for step, row in logger.rows if "both_step" in row]
    assert step_rows == [2]  # global steps 1..3, logged every 2
    epoch_row = next(row for _, row in logger.rows if "both_epoch" in row)
    assert epoch_row["epoch"] == 0 and epoch_row["n"] == 10


def test_logging_errors() -> None:
    class Bad(Regressor):
        def __init__(self, what: str) -> None:
            super().__init__()
            self.what = what

        def on_fit_start(self) -> None:
            if self.what == "outside":
                self.log("x", 1.0)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            if self.what == "vector":
                self.log("v", torch.ones(3))
            if self.what == "options":
                self.log("o", 1.0, reduce_fx="sum" if batch_idx else "mean")
            if self.what == "fx":
                self.log("f", 1.0, reduce_fx="median")
            if self.what == "none":
                return None
            return loss

    cases = {
        "outside": "outside a training/validation/test loop",
        "vector": r"got a tensor of shape \(3,\)",
        "options": "with different on_step/on_epoch/sync_dist/reduce_fx",
        "fx": "reduce_fx='median' is not supported",
        "none": "training_step returned NoneType",
    }
    for what, message in cases.items():
        trainer = phalanx.Trainer(max_epochs=1, **quiet())
        with pytest.raises(MisconfigurationError, match=message):
            trainer.fit(Bad(what), loader(8, 4))


def test_optimizer_configurations() -> None:
    class Config(Regressor):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.kind = kind

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("metric", loss, on_epoch=True)
            return loss

        def configure_optimizers(self) -> Any:
            opt = CountingSGD(self.parameters(), lr=0.01)
            if self.kind == "plain":
                return opt
            if self.kind == "lists":
                return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]
            if self.kind == "plateau":
                plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "metric"}}
            if self.kind == "plateau-nomonitor":
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}
            if self.kind == "two":
                return [opt, torch.optim.SGD(self.parameters(), lr=0.1)]
            if self.kind == "interval":
                return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1),
                                                           "interval": "batch"}}
            return {"lr_scheduler": None}

    trainer = phalanx.Trainer(max_epochs=3, **quiet())
    model = Config("lists")
    trainer.fit(model, loader(8, 4))
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**3)  # stepped once per epoch
    trainer = phalanx.Trainer(max_epochs=2, **quiet())
    trainer.fit(Config("plateau"), loader(8, 4))
    assert len(trainer.lr_scheduler_configs) == 1
    trainer = phalanx.Trainer(max_epochs=1, **quiet())
    trainer.fit(Config("plain"), loader(8, 4))
    assert trainer.lr_scheduler_configs == []
    errors = {
        "plateau-nomonitor": "ReduceLROnPlateau needs a metric",
        "two": "returned 2 optimizers",
        "interval": "interval='batch'",
        "missing": "without an 'optimizer' key",
    }
    for kind, message in errors.items():
        with pytest.raises(MisconfigurationError, match=message):
            phalanx.Trainer(max_epochs=1, **quiet()).fit(Config(kind), loader(8, 4))


def test_trainer_argument_errors() -> None:
    with pytest.raises(MisconfigurationError, match=r"accumulate_grad_batches must be >= 1"):
        phalanx.Trainer(accumulate_grad_batches=0, **quiet())
    with pytest.raises(MisconfigurationError, match=r"limit_train_batches=1.5 is a float above 1.0"):
        phalanx.Trainer(limit_train_batches=1.5, **quiet())
    with pytest.raises(MisconfigurationError, match=r"gradient_clip_algorithm"):
        phalanx.Trainer(gradient_clip_algorithm="max", **quiet())
    trainer = phalanx.Trainer(max_epochs=1, **quiet())
    with pytest.raises(MisconfigurationError, match=r"runs phalanx.Module subclasses"):
        trainer.fit(torch.nn.Linear(2, 2), loader(8, 4))  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match=r"needs training data"):
        trainer.fit(Regressor())


def test_loop_limits_and_validation_schedule() -> None:
    class CountVal(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.val_runs: list[tuple[int, int]] = []

        def on_validation_epoch_start(self) -> None:
            self.val_runs.append((self.trainer.current_epoch, self.trainer.batches_done))

    trainer = phalanx.Trainer(max_steps=5, **quiet())
    trainer.fit(Regressor(), loader(16, 4))  # 4 steps per epoch; stops in the middle of the second
    assert trainer.global_step == 5 and trainer.current_epoch == 2
    trainer = phalanx.Trainer(max_epochs=2, limit_train_batches=0.5, val_check_interval=0.5,
                              check_val_every_n_epoch=2, **quiet())
    model = CountVal()
    trainer.fit(model, loader(32, 4), loader(8, 4))  # 4 of 8 batches; validate every 2 and at epoch 2's end
    assert trainer.global_step == 8
    assert model.val_runs == [(0, 2), (1, 2), (1, 4)]
    trainer = phalanx.Trainer(max_epochs=1, limit_val_batches=0, **quiet())
    model = CountVal()
    trainer.fit(model, loader(8, 4), loader(8, 4))
    assert model.val_runs == []


def test_gradient_clipping_bounds_the_norm() -> None:
    class Clip(Regressor):
        norms: list[float] = []

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            optimizer_closure()
            norm = torch.cat([p.grad.reshape(-1) for p in self.parameters()]).norm()
            self.norms.append(float(norm))
            optimizer.step()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch, batch_idx) * 1e4

    trainer = phalanx.Trainer(max_epochs=1, gradient_clip_val=0.5, **quiet())
    model = Clip()
    trainer.fit(model, loader(16, 4))
    assert len(model.norms) == 4 and max(model.norms) == pytest.approx(0.5, rel=1e-6)


def test_validate_test_predict_and_best_checkpoint(tmp_path: Any) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val_mae", save_top_k=1)
    trainer = phalanx.Trainer(max_epochs=3, callbacks=[ckpt], **quiet(enable_checkpointing=True))
    model = Regressor()
    trainer.fit(model, loader(32, 8), loader(10, 4))
    out = trainer.validate(dataloaders=loader(10, 4), verbose=False)
    assert set(out[0]) == {"val_mae", "val_abs_sum", "val_max"}
    assert out[0]["val_mae"] == pytest.approx(float(trainer.callback_metrics["val_mae"]), rel=1e-12)
    best = ckpt.best_model_score
    assert best is not None and best == min(ckpt.best_k_models.values())
    tested = trainer.test(dataloaders=[loader(10, 4), loader(6, 3)], ckpt_path="best", verbose=False)
    assert len(tested) == 2 and set(tested[1]) == {"test_mae/dataloader_idx_1"}
    preds = trainer.predict(dataloaders=loader(10, 4))
    assert [p.shape[0] for p in preds] == [4, 4, 2]


def test_datamodule_flow() -> None:
    class Data(phalanx.DataModule):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def prepare_data(self) -> None:
            self.calls.append("prepare")

        def setup(self, stage: str) -> None:
            self.calls.append(f"setup:{stage}")

        def train_dataloader(self) -> Any:
            return loader(8, 4)

        def val_dataloader(self) -> Any:
            return loader(4, 4)

        def test_dataloader(self) -> Any:
            return loader(4, 2)

    data = Data()
    trainer = phalanx.Trainer(max_epochs=1, **quiet())
    trainer.fit(Regressor(), datamodule=data)
    trainer.test(datamodule=data, verbose=False)
    assert data.calls == ["prepare", "setup:fit", "prepare", "setup:test"]
    assert "val_mae" in trainer.callback_metrics and "test_mae" in trainer.callback_metrics


def test_windows_know_the_last_partial_window_without_a_length() -> None:
    sized = list(windows(iter(range(10)), 0, 10, 4))
    unsized = list(windows(iter(range(10)), 0, None, 4))
    assert sized == unsized
    assert [(i, size, boundary) for i, _, size, boundary in sized][-3:] == [(7, 4, True), (8, 2, False), (9, 2, True)]


def test_iterable_dataset_with_accumulation_matches_map_style() -> None:
    class Stream(IterableDataset[Any]):
        def __iter__(self) -> Any:
            x, y = dataset(40).tensors
            return iter(zip(x, y))

    t1 = phalanx.Trainer(max_epochs=1, accumulate_grad_batches=4, **quiet())
    m1 = Regressor()
    t1.fit(m1, DataLoader(Stream(), batch_size=4))
    t2 = phalanx.Trainer(max_epochs=1, accumulate_grad_batches=4, **quiet())
    m2 = Regressor()
    t2.fit(m2, loader(40, 4))
    assert t1.global_step == t2.global_step == 3
    torch.testing.assert_close(flat(m1), flat(m2), rtol=0, atol=1e-12)


def test_train_sampler_resumes_and_shards_like_one_process() -> None:
    one = TrainSampler(10, 1, 0, shuffle=True, seed=3)
    one.set_epoch(2)
    order = list(one)
    shards = [TrainSampler(10, 2, r, shuffle=True, seed=3) for r in (0, 1)]
    for s in shards:
        s.set_epoch(2)
    assert sorted(list(shards[0]) + list(shards[1])) == sorted(order)
    assert list(shards[0]) == order[0::2]
    skipping = TrainSampler(10, 2, 1, shuffle=True, seed=3)
    skipping.set_epoch(2)
    skipping.skip = 4
    assert list(skipping) == order[1::2][2:]
    assert list(skipping) == order[1::2]  # the skip applies to one pass only


@pytest.mark.parametrize("length", [0, 1, 7, 12])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("skip", [0, 5])
def test_train_sampler_in_data_order_equals_the_padded_list(length: int, world: int, skip: int) -> None:
    """Unshuffled, the sampler iterates a range where nothing is padded or skipped: the indices must be
    those of the general rule (pad to a multiple of the ranks, skip, pad again, take every world-th)."""
    def rule(rank: int, skip: int) -> list[int]:
        padded = list(range(length))
        while padded and len(padded) % world:
            padded += padded[: world - len(padded) % world]
        rest = padded[skip:]
        while rest and len(rest) % world:
            rest += rest[: world - len(rest) % world]
        return rest[rank::world]

    for rank in range(world):
        sampler = TrainSampler(length, world, rank, shuffle=False, seed=0)
        sampler.skip = skip
        assert list(sampler) == rule(rank, skip)
        assert list(sampler) == rule(rank, 0)  # the skip applies to one pass only


@pytest.mark.parametrize(("n", "world", "batch"), [(37, 2, 8), (10, 3, 4), (16, 2, 8), (9, 2, 4), (5, 4, 2)])
def test_eval_sampler_scores_each_sample_once_with_equal_batch_counts(n: int, world: int, batch: int) -> None:
    samplers = [EvalBatchSampler(n, world, r, batch) for r in range(world)]
    indices = [i for s in samplers for b in s for i in b]
    assert sorted(indices) == list(range(n))
    assert len({len(s) for s in samplers}) == 1
    assert all(0 < len(b) <= batch for s in samplers for b in s)
    assert len(samplers[0]) == math.ceil(math.ceil(n / world) / batch)


def test_eval_sampler_refuses_what_cannot_be_split() -> None:
    with pytest.raises(MisconfigurationError, match=r"cannot be split across 2 ranks"):
        EvalBatchSampler(5, 2, 1, 1)
    with pytest.raises(MisconfigurationError, match=r"cannot be split across 4 ranks"):
        EvalBatchSampler(3, 4, 3, 2)


@pytest.mark.parametrize("length", [0, 7, 10])
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("skip", [0, 4, 30])
def test_train_sampler_length_is_arithmetic(
    monkeypatch: pytest.MonkeyPatch, length: int, world: int, skip: int
) -> None:
    """``len()`` is asked for often (progress bars, limits, schedulers): it must not draw the permutation."""
    sampler = TrainSampler(length, world, world - 1, shuffle=True, seed=5)
    sampler.skip = skip
    with monkeypatch.context() as m:
        m.setattr(torch, "randperm", lambda *a, **k: pytest.fail("__len__ drew a permutation"))
        n = len(sampler)
    assert n == len(list(sampler))


def test_deterministic_mode_lasts_for_the_run_only() -> None:
    """``torch.use_deterministic_algorithms`` is process-wide: the Trainer must give it back."""
    seen: list[bool] = []

    class Probe(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(torch.are_deterministic_algorithms_enabled())
            return super().training_step(batch, batch_idx)

    class Boom(Probe):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            super().training_step(batch, batch_idx)
            raise RuntimeError("boom")

    assert not torch.are_deterministic_algorithms_enabled()
    trainer = phalanx.Trainer(max_epochs=1, deterministic=True, **quiet())
    assert not torch.are_deterministic_algorithms_enabled()  # constructing a Trainer changes nothing
    trainer.fit(Probe(), loader(8, 4))
    assert seen == [True, True] and not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="boom"):
        phalanx.Trainer(max_epochs=1, deterministic=True, **quiet()).fit(Boom(), loader(8, 4))
    assert seen[-1] is True and not torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # a setting of the user's own survives too
    try:
        phalanx.Trainer(max_epochs=1, deterministic=True, **quiet()).fit(Probe(), loader(8, 4))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_resuming_from_last_without_a_checkpoint_says_so(tmp_path: Any) -> None:
    trainer = phalanx.Trainer(max_epochs=1, default_root_dir=tmp_path, **quiet(enable_checkpointing=True))
    with pytest.warns(PhalanxWarning, match=r"ckpt_path='last': no last\.ckpt in the ModelCheckpoint "
                                                    r"folders .*; training starts from scratch\. Give ModelCheckpoint "
                                                    r"save_last=True"):
        trainer.fit(Regressor(), loader(8, 4), ckpt_path="last")
    assert trainer.global_step == 2


def test_resuming_from_last_before_a_configured_checkpoint_exists_is_no_warning(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """save_last=True with a fixed dirpath is the advice itself: the first attempt of such a run only
    says it starts from scratch (at INFO), and a second attempt resumes from what the first wrote."""
    def make() -> phalanx.Trainer:
        checkpoint = ModelCheckpoint(tmp_path / "ckpt", save_last=True)
        return phalanx.Trainer(max_epochs=1, callbacks=[checkpoint], **quiet(enable_checkpointing=True))

    with warnings.catch_warnings():
        warnings.simplefilter("error", PhalanxWarning)
        with caplog.at_level(logging.INFO, logger="phalanx"):
            make().fit(Regressor(), loader(8, 4), ckpt_path="last")
    assert "no last.ckpt in" in caplog.text and "yet; training starts from scratch" in caplog.text
    second = make()
    second.fit(Regressor(), loader(8, 4), ckpt_path="last")
    assert second.global_step == 2 and second.current_epoch == 1


def test_a_scheduler_built_on_the_set_up_optimizer_during_fit_sees_every_step() -> None:
    """torch's LR schedulers wrap ``optimizer.step`` of the optimizer they are given, to know it ran before
    their own step. One built mid-fit on ``trainer.optimizers[0]`` (e.g. by a callback that needs the
    run's length) must see the Trainer's steps: no "scheduler.step() before optimizer.step()" warning,
    and its learning rate decays once per optimizer step."""

    class LateScheduler(phalanx.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.sched = torch.optim.lr_scheduler.StepLR(trainer.optimizers[0], step_size=1, gamma=0.5)

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            self.sched.step()

    late = LateScheduler()
    trainer = phalanx.Trainer(max_epochs=1, callbacks=[late], **quiet())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # torch warns on the order with a UserWarning
        trainer.fit(Regressor(lr=0.1, scheduler=False), loader(16, 4))
    assert trainer.global_step == 4
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    assert late.sched.optimizer._opt_called is True  # type: ignore[attr-defined]


def test_settings_are_frozen_and_read_through_the_trainer() -> None:
    """The resolved arguments live in one frozen Settings; the Trainer's attributes of the same names read it."""
    import dataclasses

    trainer = phalanx.Trainer(max_epochs=None, max_steps=-1, limit_val_batches=0.5, gradient_clip_val=1.0,
                              accumulate_grad_batches=2, **quiet())
    s = trainer.settings
    assert (trainer.max_epochs, trainer.limit_val_batches, trainer.gradient_clip_val) == (1000, 0.5, 1.0)
    assert trainer.max_epochs == s.max_epochs and trainer.default_root_dir == s.default_root_dir
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_epochs = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        trainer.max_epochs = 3  # type: ignore[misc]
    # Accumulation is read from a schedule (constant here), never written.
    with pytest.raises(AttributeError):
        trainer.accumulate_grad_batches = 4  # type: ignore[misc]
    assert trainer.accumulate_grad_batches == 2 and trainer.accumulation.scheduling == {0: 2}


def test_loop_state_holds_the_counters_and_round_trips() -> None:
    from phalanx.trainer.state import LoopState

    trainer = phalanx.Trainer(max_epochs=2, **quiet())
    trainer.fit(Regressor(scheduler=False), loader(8, 4))
    state = trainer.loop_state
    assert (state.global_step, state.current_epoch) == (trainer.global_step, trainer.current_epoch) == (4, 2)
    trainer.should_stop = True
    assert state.stop_requested
    mid = LoopState(global_step=7, current_epoch=1, batches_done=3, stop_requested=True)
    saved = mid.state_dict(world_size=2, samples_per_batch=8)
    assert saved["samples_consumed"] == 24 and saved["epoch"] == 1
    back = LoopState()
    back.load_state_dict(saved)
    assert (back.global_step, back.current_epoch, back.batches_done, back.stop_requested) == (7, 1, 3, True)
    finished = LoopState(global_step=7, current_epoch=1, batches_done=3, epoch_finished=True)
    assert finished.state_dict(1, 4)["epoch"] == 2 and finished.state_dict(1, 4)["batches_done"] == 0
    copy = mid.restore_point()
    mid.global_step = 99
    mid.restore(copy)
    assert mid.global_step == 7 and mid == copy and mid is not copy
