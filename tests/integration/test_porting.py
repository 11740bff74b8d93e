"""Lightning code on phalanx with only its imports changed (issue 15), single process: the names, the
Trainer arguments (implemented or refused), hyperparameters, the module's own dataloaders, hooks,
automatic and manual optimization, load_from_checkpoint, and Fabric's collective semantics."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import pytest
import torch
from porting_models import TwoOptimizers, data, flat, manual_reference
from run_if import run_if
from torch import nn
from torch.utils.data import DataLoader

import phalanx as L
from phalanx.utils.errors import MisconfigurationError

# Lightning 2.6.6's Trainer.__init__ parameters (from inspect.signature in the peer venv).
LIGHTNING_TRAINER_ARGS = [
    "accelerator", "strategy", "devices", "num_nodes", "precision", "logger", "callbacks", "fast_dev_run",
    "max_epochs", "min_epochs", "max_steps", "min_steps", "max_time", "limit_train_batches", "limit_val_batches",
    "limit_test_batches", "limit_predict_batches", "overfit_batches", "val_check_interval", "check_val_every_n_epoch",
    "num_sanity_val_steps", "log_every_n_steps", "enable_checkpointing", "enable_progress_bar", "enable_model_summary",
    "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm", "deterministic", "benchmark",
    "inference_mode", "use_distributed_sampler", "profiler", "detect_anomaly", "barebones", "plugins",
    "sync_batchnorm", "reload_dataloaders_every_n_epochs", "default_root_dir", "enable_autolog_hparams",
    "model_registry",
]


def quiet(**kwargs: Any) -> dict[str, Any]:
    base = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
            "enable_model_summary": False}
    base.update(kwargs)
    return base


class Net(L.LightningModule):
    def __init__(self, lr: float = 0.1, hidden: int = 8, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.calls: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> Any:
        return DataLoader(data(32), batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> Any:
        return DataLoader(data(16, seed=1), batch_size=8)

    def test_dataloader(self) -> Any:
        return DataLoader(data(16, seed=2), batch_size=8)

    def predict_dataloader(self) -> Any:
        return DataLoader(data(16, seed=2), batch_size=8)


# ---------------------------------------------------------------------------------------------- names
def test_lightning_names_exist_and_are_phalanx_classes() -> None:
    assert L.LightningModule is L.Module and L.LightningDataModule is L.DataModule
    assert L.Callback is L.callbacks.Callback
    for name in ("ModelCheckpoint", "EarlyStopping", "LearningRateMonitor", "LearningRateFinder", "ModelSummary",
                 "RichModelSummary", "Timer", "BatchSizeFinder", "TQDMProgressBar", "RichProgressBar",
                 "LambdaCallback", "BasePredictionWriter", "ProgressBar"):
        assert hasattr(L.callbacks, name), name
    for name in ("CSVLogger", "TensorBoardLogger", "MLFlowLogger", "WandbLogger", "Logger"):
        assert hasattr(L.loggers, name), name
    for name in ("SimpleProfiler", "AdvancedProfiler", "PyTorchProfiler", "PassThroughProfiler", "Profiler"):
        assert hasattr(L.profilers, name), name
    from phalanx.cli import LightningCLI
    from phalanx.tuner.lr_find import Tuner
    from phalanx.utilities import rank_zero_only

    assert LightningCLI is L.LightningCLI and callable(Tuner.scale_batch_size) and callable(rank_zero_only)


def test_trainer_accepts_every_lightning_argument_name() -> None:
    import inspect

    params = inspect.signature(L.Trainer.__init__).parameters
    missing = [name for name in LIGHTNING_TRAINER_ARGS if name not in params]
    assert missing == []


def test_refused_arguments_say_what_to_do() -> None:
    cases = [
        ({"plugins": ["something"]}, r"plugins=.*precision=\.\.\."),
        ({"model_registry": "hub"}, r"model_registry=.*uploads nothing"),
        ({"val_check_interval": "00:00:10:00"}, r"time interval.*Pass an int"),
        ({"barebones": True, "enable_checkpointing": True}, r"barebones=True.*enable_checkpointing"),
        ({"barebones": True, "log_every_n_steps": 5}, r"barebones=True\) logs nothing"),
        ({"deterministic": True, "benchmark": True}, r"benchmark=True.*deterministic"),
        ({"fast_dev_run": -1}, r"fast_dev_run=-1"),
        ({"num_sanity_val_steps": -2}, r"num_sanity_val_steps=-2"),
        ({"deterministic": "sometimes"}, r"deterministic='sometimes'"),
    ]
    for kwargs, match in cases:
        with pytest.raises(MisconfigurationError, match=match):
            L.Trainer(**{"accelerator": "cpu", **kwargs})
    with pytest.raises(MisconfigurationError, match=r"plugins="):
        L.Fabric(accelerator="cpu", plugins=["x"])


def test_constructing_a_multiprocess_trainer_starts_nothing() -> None:
    # Under plain python, Trainer(devices=2) used to re-run the script from inside the constructor.
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    assert trainer.world_size == 2 and trainer.global_rank == 0 and not trainer.fabric.launched


def test_ranks_known_from_the_environment_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fabric = L.Fabric(accelerator="cpu", devices=2, num_nodes=2)
    assert (fabric.global_rank, fabric.world_size, fabric.local_rank, fabric.node_rank) == (3, 4, 1, 1)
    assert not fabric.is_global_zero
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, logger=False)
    assert (trainer.global_rank, trainer.world_size, trainer.is_global_zero) == (3, 4, False)


# ---------------------------------------------------------------------------------------------- hparams
def test_hparams_is_an_attribute_dict_of_init_arguments() -> None:
    class Base(L.LightningModule):
        def __init__(self, width: int, note: str = "x", **kwargs: Any) -> None:
            super().__init__()
            unused_local = 5  # locals that are not arguments are never recorded
            del unused_local
            self.save_hyperparameters(ignore=["note"])

    class Child(Base):
        def __init__(self, width: int = 3, depth: int = 2, encoder: nn.Module | None = None) -> None:
            super().__init__(width * 2, extra=depth)

    model = Child(width=5, depth=7)
    assert model.hparams.width == 5 and model.hparams.depth == 7 and model.hparams.extra == 7
    assert "note" not in model.hparams and "unused_local" not in model.hparams
    assert model.hparams == {"width": 5, "depth": 7, "encoder": None, "extra": 7}
    model.hparams.width = 9
    assert model.hparams_initial.width == 5

    class Named(L.LightningModule):
        def __init__(self, a: int = 1, b: int = 2, c: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters("a", "c")

    assert Named().hparams == {"a": 1, "c": 3}

    class FromNamespace(L.LightningModule):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.save_hyperparameters(config)

    assert FromNamespace(argparse.Namespace(lr=0.5, n=2)).hparams.lr == 0.5
    assert FromNamespace({"lr": 0.25}).hparams.lr == 0.25
    with pytest.raises(MisconfigurationError, match=r"single int is not a set of hyperparameters"):
        FromNamespace(3)

    @dataclasses.dataclass
    class Config:
        lr: float = 0.1

    with pytest.raises(MisconfigurationError, match=r"got a Config.*dataclass"):
        FromNamespace(Config())

    class TakesConfig(L.LightningModule):
        def __init__(self, config: Config) -> None:
            super().__init__()
            self.save_hyperparameters()

    assert TakesConfig(Config(0.3)).hparams.config.lr == 0.3

    class DM(L.LightningDataModule):
        def __init__(self, batch_size: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters()

    assert DM(16).hparams.batch_size == 16


# ---------------------------------------------------------------------------------------------- data
def test_fit_uses_the_modules_own_dataloaders() -> None:
    model = Net()
    trainer = L.Trainer(max_epochs=1, num_sanity_val_steps=0, **quiet())
    trainer.fit(model)
    assert trainer.global_step == 4 and "val_loss" in trainer.callback_metrics
    assert trainer.test(model, verbose=False)[0]["test_loss"] > 0
    preds = trainer.predict(model)
    assert len(preds) == 2 and preds[0].shape == (8, 1)
    assert trainer.predict(model, return_predictions=False) is None


def test_datamodule_in_the_dataloaders_place_and_its_hooks() -> None:
    events: list[str] = []

    class DM(L.LightningDataModule):
        def prepare_data(self) -> None:
            events.append("prepare_data")

        def setup(self, stage: str) -> None:
            events.append(f"setup:{stage}")

        def train_dataloader(self) -> Any:
            return DataLoader(data(16), batch_size=8)

        def teardown(self, stage: str) -> None:
            events.append(f"teardown:{stage}")

    trainer = L.Trainer(max_epochs=1, **quiet())
    trainer.fit(Net(), DM())
    assert events == ["prepare_data", "setup:fit", "teardown:fit"] and trainer.global_step == 2
    with pytest.raises(MisconfigurationError, match=r"both dataloaders and a datamodule"):
        trainer.fit(Net(), DataLoader(data(8)), datamodule=DM())
    dm = L.LightningDataModule.from_datasets(data(16), batch_size=4)
    trainer = L.Trainer(max_epochs=1, **quiet())
    trainer.fit(Net(), datamodule=dm)
    assert trainer.global_step == 4


# ---------------------------------------------------------------------------------------------- hooks
class Recorder(L.Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_") or name in ("setup", "teardown"):
            calls = object.__getattribute__(self, "calls")
            return lambda *a, **k: calls.append(name)
        return object.__getattribute__(self, name)


def test_hook_order_follows_lightning() -> None:
    module_hooks = ("on_train_start", "on_train_end", "on_before_backward", "on_after_backward", "on_before_zero_grad",
                    "on_validation_start", "on_validation_end", "on_validation_batch_start")

    def recording(name: str) -> Any:
        def hook(self: Any, *a: Any, **k: Any) -> Any:
            self.calls.append(name)
            return getattr(Net, name)(self, *a, **k)
        return hook

    # Overrides, as a user writes them (the Trainer skips Module's no-op defaults that are not overridden).
    Hooked = type("Hooked", (Net,), {name: recording(name) for name in module_hooks})
    model = Hooked()
    callback = Recorder()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=1,
                        callbacks=[callback], **quiet())
    trainer.fit(model)
    fit_calls = [c for c in callback.calls if c != "on_before_optimizer_step"]
    assert fit_calls[:4] == ["setup", "on_fit_start", "on_sanity_check_start", "on_validation_start"]
    assert "on_sanity_check_end" in fit_calls and fit_calls.index("on_sanity_check_end") < fit_calls.index(
        "on_train_start")
    expected_batch = ["on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
                      "on_before_optimizer_step", "on_train_batch_end"]
    batch = [c for c in callback.calls if c in expected_batch]
    assert batch == expected_batch
    assert callback.calls[-3:] == ["on_train_end", "on_fit_end", "teardown"]
    for hook in module_hooks:
        assert hook in model.calls, hook


def test_batch_transfer_hooks_are_refused_and_model_train_hooks_called() -> None:
    class Transfers(Net):
        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            return batch

    with pytest.raises(MisconfigurationError, match=r"on_after_batch_transfer.*collate_fn"):
        L.Trainer(max_epochs=1, **quiet()).fit(Transfers())
    calls: list[str] = []

    class Modes(Net):
        def on_validation_model_train(self) -> None:
            calls.append("train")
            super().on_validation_model_train()

    model = Modes()
    L.Trainer(max_epochs=1, limit_train_batches=1, num_sanity_val_steps=0, **quiet()).fit(model)
    assert calls == ["train"] and model.training
    L.Trainer(**quiet()).validate(model, verbose=False)
    assert calls == ["train", "train"] and model.training  # the mode from before validation is restored
    model.eval()
    L.Trainer(**quiet()).validate(model, verbose=False)
    assert calls == ["train", "train"] and not model.training


def test_sanity_check_leaves_no_trace() -> None:
    def run(sanity: int) -> tuple[torch.Tensor, list[Any]]:
        L.seed_everything(3, verbose=False)
        model = Net()
        rows: list[Any] = []

        class Log(L.loggers.Logger):
            def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
                rows.append((step, dict(metrics)))

        class Shuffled(Net):
            def train_dataloader(self) -> Any:
                return DataLoader(data(32), batch_size=8, shuffle=True)

        model = Shuffled()
        model.layer.insert(1, nn.Dropout(0.2))  # draws from the RNG in training only
        trainer = L.Trainer(max_epochs=2, num_sanity_val_steps=sanity, logger=Log(), accelerator="cpu",
                            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
        trainer.fit(model)
        return flat(model), rows

    with_check, rows_with = run(2)
    without, rows_without = run(0)
    assert torch.equal(with_check, without)
    assert rows_with == rows_without  # nothing from the sanity check reached the loggers


def test_optimizer_step_override_with_lightnings_signature_and_closure() -> None:
    class WarmUp(Net):
        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            scale = min(1.0, (self.trainer.global_step + 1) / 4)
            for group in optimizer.param_groups:
                group["lr"] = scale * self.hparams.lr
            optimizer.step(closure=optimizer_closure)

    model = WarmUp()
    trainer = L.Trainer(max_epochs=1, **quiet())
    trainer.fit(model, DataLoader(data(32), batch_size=8))
    assert trainer.global_step == 4

    # The same updates by hand.
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, (x, y) in enumerate(DataLoader(data(32), batch_size=8)):
        for group in opt.param_groups:
            group["lr"] = min(1.0, (step + 1) / 4) * 0.1
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    assert torch.allclose(flat(model), flat(ref), atol=1e-6)

    class Forgets(Net):
        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            pass

    with pytest.raises(MisconfigurationError, match=r"did not run its optimizer_closure"):
        L.Trainer(max_epochs=1, **quiet()).fit(Forgets())


def test_configure_gradient_clipping_override_receives_trainer_settings() -> None:
    seen: list[Any] = []

    class Clips(Net):
        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                        gradient_clip_algorithm: Any = None) -> None:
            seen.append((gradient_clip_val, gradient_clip_algorithm))
            self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")

    model = Clips()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, **quiet())
    before = flat(model).clone()
    trainer.fit(model)
    assert seen == [(None, "norm")]
    assert float((flat(model) - before).abs().max()) <= 0.1 * 0.01 + 1e-7  # lr * clip value


def test_overrides_of_backward_and_zero_grad_run_and_late_callbacks_join_at_the_next_epoch() -> None:
    """What a step calls is decided once per epoch (stepping.StepPlan): an overridden ``backward`` and
    ``optimizer_zero_grad`` run at every step instead of the defaults, and a callback added during an
    epoch takes part from the next epoch on (docs/trainer.md)."""
    zero_grads: list[int] = []
    late: list[tuple[int, int]] = []

    class Custom(Net):
        def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            super().backward(loss * 2, *args, **kwargs)  # as if the learning rate were doubled

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            zero_grads.append(batch_idx)
            optimizer.zero_grad()

    class Late(L.Callback):
        def on_before_backward(self, trainer: Any, module: Any, loss: torch.Tensor) -> None:
            late.append((trainer.current_epoch, trainer.global_step))

    class AddsLate(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.current_epoch == 0 and batch_idx == 0:
                trainer.callbacks.append(Late())

    model = Custom()
    L.Trainer(max_epochs=2, callbacks=[AddsLate()], **quiet()).fit(model)
    assert zero_grads == [0, 1, 2, 3] * 2
    assert late == [(1, 4), (1, 5), (1, 6), (1, 7)]

    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    for _ in range(2):
        for x, y in DataLoader(data(32), batch_size=8):
            opt.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            opt.step()
    assert torch.allclose(flat(model), flat(ref), atol=1e-6)


# ---------------------------------------------------------------------------------------------- manual optimization


def test_manual_optimization_matches_a_hand_written_loop() -> None:
    loader = DataLoader(data(24), batch_size=8)
    model = TwoOptimizers()
    trainer = L.Trainer(max_epochs=1, **quiet())
    trainer.fit(model, loader)
    assert trainer.global_step == 6  # two optimizer steps per batch, as in Lightning
    assert set(trainer.callback_metrics) == {"d_loss", "g_loss"}
    assert torch.allclose(flat(model), flat(manual_reference(list(loader))), atol=1e-6)
    assert all(p.requires_grad for p in model.parameters())


def test_manual_optimization_refuses_automatic_only_arguments() -> None:
    with pytest.raises(MisconfigurationError, match=r"accumulate_grad_batches is for automatic optimization"):
        L.Trainer(max_epochs=1, accumulate_grad_batches=2, **quiet()).fit(TwoOptimizers(), DataLoader(data(8)))
    with pytest.raises(MisconfigurationError, match=r"self.clip_gradients"):
        L.Trainer(max_epochs=1, gradient_clip_val=1.0, **quiet()).fit(TwoOptimizers(), DataLoader(data(8)))
    with pytest.raises(MisconfigurationError, match=r"automatic_optimization = False"):
        class Auto(TwoOptimizers):
            def __init__(self) -> None:
                super().__init__()
                self.automatic_optimization = True
        L.Trainer(max_epochs=1, **quiet()).fit(Auto(), DataLoader(data(8)))


@run_if(fsdp=True)
def test_manual_optimization_is_refused_on_sharding_strategies() -> None:
    trainer = L.Trainer(max_epochs=1, strategy="fsdp", devices=1, **quiet())
    with pytest.raises(MisconfigurationError, match=r"Manual optimization .* strategy='fsdp'"):
        trainer.fit(TwoOptimizers(), DataLoader(data(8)))
    trainer.fabric.teardown()


# ---------------------------------------------------------------------------------------------- checkpoints
def test_load_from_checkpoint_rebuilds_with_saved_hyperparameters(tmp_path: Any) -> None:
    model = Net(lr=0.2, hidden=6)
    trainer = L.Trainer(max_epochs=1, **quiet())
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    loaded = Net.load_from_checkpoint(tmp_path / "m.ckpt")
    assert loaded.hparams == {"lr": 0.2, "hidden": 6, "batch_size": 8}
    assert torch.equal(flat(loaded), flat(model))
    assert Net.load_from_checkpoint(tmp_path / "m.ckpt", lr=0.5).hparams.lr == 0.5
    with pytest.raises(Exception, match=r"size mismatch|shape"):
        Net.load_from_checkpoint(tmp_path / "m.ckpt", hidden=3)
    # weights_only=False is the explicit opt-in for trusted files; a phalanx file loads either way.
    assert torch.equal(flat(Net.load_from_checkpoint(tmp_path / "m.ckpt", weights_only=False)), flat(model))
    with pytest.raises(MisconfigurationError, match=r"storage_options"):
        trainer.save_checkpoint(tmp_path / "x.ckpt", storage_options={"a": 1})


# ---------------------------------------------------------------------------------------------- Trainer flags
def test_fast_dev_run_runs_one_batch_and_writes_nothing(tmp_path: Any) -> None:
    model = Net()
    trainer = L.Trainer(fast_dev_run=True, default_root_dir=tmp_path, accelerator="cpu", enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model)
    assert trainer.global_step == 1 and trainer.current_epoch == 1
    assert list(tmp_path.iterdir()) == []  # no logs, no checkpoints
    assert len(trainer.test(model, verbose=False)) == 1 and trainer.num_test_batches == [1]


def test_min_epochs_defers_a_stop_request() -> None:
    class StopsAtOnce(Net):
        def on_train_epoch_end(self) -> None:
            self.trainer.should_stop = True

    trainer = L.Trainer(max_epochs=10, min_epochs=3, **quiet())
    trainer.fit(StopsAtOnce())
    assert trainer.current_epoch == 3
    trainer = L.Trainer(max_epochs=10, min_steps=6, **quiet())
    trainer.fit(StopsAtOnce())
    assert trainer.global_step == 6  # the request waits until 6 steps are done (mid-epoch, as in Lightning)


def test_overfit_batches_reads_the_same_first_batches() -> None:
    seen: list[torch.Tensor] = []

    class Records(Net):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(batch[0].clone())
            return super().training_step(batch, batch_idx)

        def train_dataloader(self) -> Any:
            return DataLoader(data(32), batch_size=8, shuffle=True)

    with pytest.warns(L.errors.PhalanxWarning, match=r"overfit_batches"):
        L.Trainer(max_epochs=2, overfit_batches=2, **quiet()).fit(Records())
    assert len(seen) == 4 and torch.equal(seen[0], seen[2]) and torch.equal(seen[1], seen[3])
    assert torch.equal(seen[0], data(32).tensors[0][:8])


def test_on_train_batch_start_minus_one_ends_the_epoch_and_reload_dataloaders() -> None:
    calls = {"loaders": 0}

    class Skips(Net):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
            return -1 if batch_idx == 2 else None

        def train_dataloader(self) -> Any:
            calls["loaders"] += 1
            return super().train_dataloader()

    trainer = L.Trainer(max_epochs=4, reload_dataloaders_every_n_epochs=2, **quiet())
    trainer.fit(Skips())
    assert trainer.global_step == 8  # 2 of 4 batches per epoch
    assert calls["loaders"] == 2  # at fit start and again at epoch 2


def test_max_time_and_timer() -> None:
    trainer = L.Trainer(max_epochs=1000, max_time={"seconds": 0}, **quiet())
    trainer.fit(Net())
    assert trainer.global_step == 1  # the budget is spent after the first step
    timer = next(c for c in trainer.callbacks if isinstance(c, L.callbacks.Timer))
    assert timer.time_elapsed("train") >= 0 and timer.time_remaining() is not None and timer.time_remaining() <= 0


def test_inference_mode_and_deterministic_warn() -> None:
    modes: list[bool] = []

    class Checks(Net):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            modes.append(torch.is_inference_mode_enabled())
            super().validation_step(batch, batch_idx)

    L.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=1, **quiet()).fit(Checks())
    L.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=1, inference_mode=False, **quiet()).fit(Checks())
    assert modes == [True, True, False, False]  # sanity check + validation, each mode
    seen: list[tuple[bool, bool]] = []

    class Probe(Net):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen.append((torch.are_deterministic_algorithms_enabled(),
                         torch.is_deterministic_algorithms_warn_only_enabled()))
            return super().training_step(batch, batch_idx)

    L.Trainer(deterministic="warn", max_epochs=1, limit_train_batches=1, **quiet()).fit(Probe())
    assert seen == [(True, True)]  # "warn" mode while the run runs ...
    assert not torch.are_deterministic_algorithms_enabled()  # ... and the process's setting back after it


def test_sync_batchnorm_converts_and_refuses_cpu_processes() -> None:
    class BN(Net):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    model = BN()
    L.Trainer(max_epochs=1, limit_train_batches=1, sync_batchnorm=True, **quiet()).fit(model)
    assert isinstance(model.layer[1], nn.SyncBatchNorm)


@pytest.mark.parametrize("name", ["simple", "advanced", "pytorch"])
def test_profilers_report(name: str, tmp_path: Any) -> None:
    profiler = {"simple": L.profilers.SimpleProfiler, "advanced": L.profilers.AdvancedProfiler,
                "pytorch": L.profilers.PyTorchProfiler}[name](dirpath=tmp_path, filename="perf")
    L.Trainer(max_epochs=1, limit_train_batches=2, profiler=profiler, **quiet()).fit(Net())
    report = (tmp_path / "fit-perf-rank0.txt").read_text()
    if name == "simple":
        for action in ("run_training_batch", "[LightningModule]Net.training_step", "backward", "optimizer_step"):
            assert action in report, action
        assert "[Callback]" not in report or "calls" in report
    elif name == "advanced":
        assert "Profile stats for: run_training_batch" in report and "cumulative" in report
    else:
        assert "aten::" in report and (tmp_path / "fit-perf-rank0.pt.trace.json").is_file()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, profiler="simple", **quiet())
    trainer.fit(Net())  # no dirpath: the report goes to the phalanx logger


def test_model_summary_table(capsys: Any, caplog: Any) -> None:
    from phalanx.callbacks.model_summary import ModelSummary, summarize

    model = Net(hidden=16)
    model.example_input_array = torch.zeros(2, 4)
    summary = summarize(model, max_depth=2)
    assert summary.total_parameters == 4 * 16 + 16 + 16 + 1 == summary.trainable_parameters
    assert summary.layer_names == ["layer", "layer.0", "layer.1", "layer.2"]
    assert summary.in_sizes[1] == [2, 4] and summary.out_sizes[1] == [2, 16]
    text = str(summary)
    assert "In sizes" in text and "Trainable params" in text and "97" in text
    model.layer[0].requires_grad_(False)
    assert summarize(model).non_trainable_parameters == 80
    assert "Linear" in ModelSummary(max_depth=2).render(summary)


# ---------------------------------------------------------------------------------------------- tuner
class OOMAbove(Net):
    """Runs out of "memory" for batches larger than ``limit`` (a stand-in for a GPU OOM)."""

    def __init__(self, limit: int = 20, batch_size: int = 2) -> None:
        super().__init__(batch_size=batch_size)
        self.limit = limit

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if len(batch[0]) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> Any:
        return DataLoader(data(256), batch_size=self.hparams.batch_size, shuffle=True)


def test_scale_batch_size_finds_the_limit_and_leaves_no_trace() -> None:
    from phalanx.tuner.lr_find import Tuner
    from phalanx.utils.seed import capture_rng_state

    L.seed_everything(1, verbose=False)
    model = OOMAbove(limit=20)
    trainer = L.Trainer(max_epochs=1, **quiet())
    before, rng = flat(model).clone(), capture_rng_state()
    found = Tuner(trainer).scale_batch_size(model, mode="power")
    assert found == 16 and model.hparams.batch_size == 16
    assert torch.equal(flat(model), before) and torch.equal(capture_rng_state()["torch"], rng["torch"])
    assert trainer.global_step == 0 and trainer.callback_metrics == {}
    assert Tuner(trainer).scale_batch_size(model, mode="binsearch", margin=0.0) == 20
    trainer.fit(model)
    assert trainer.train_dataloader.loader.batch_size == 20
    with pytest.raises(MisconfigurationError, match=r"dataloaders passed in"):
        Tuner(trainer).scale_batch_size(model, train_dataloaders=DataLoader(data(8)))


def test_lr_find_updates_the_attribute_by_default() -> None:
    from phalanx.tuner.lr_find import Tuner

    class WithLr(Net):
        def __init__(self) -> None:
            super().__init__()
            self.lr = 0.1

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    model = WithLr()
    result = Tuner(L.Trainer(max_epochs=1, **quiet())).lr_find(model, num_training=100)
    assert model.lr == result.suggestion() and model.lr != 0.1


# ---------------------------------------------------------------------------------------------- Fabric
def test_fabric_collectives_on_one_process_have_lightnings_shapes() -> None:
    fabric = L.Fabric(accelerator="cpu")
    fabric.launch()
    assert fabric.all_gather(3).tolist() == [3] and fabric.all_gather(True).tolist() == [True]
    assert fabric.all_gather(torch.ones(2, 3)).shape == (1, 2, 3)
    assert fabric.all_gather({"a": 1.5, "b": [torch.zeros(2)]})["b"][0].shape == (1, 2)
    t = torch.tensor([2.0, 4.0])
    assert fabric.all_reduce(t, reduce_op="sum") is t
    assert fabric.all_reduce(5).item() == 5 and fabric.all_reduce(2.5, reduce_op=torch.distributed.ReduceOp.MAX) == 2.5
    with pytest.raises(MisconfigurationError, match=r"truncated"):
        fabric.all_reduce(torch.tensor([1, 2]))
    with pytest.raises(MisconfigurationError, match=r"group="):
        fabric.all_gather(torch.ones(1), group=object())
    x = torch.ones(3, requires_grad=True)
    fabric.all_gather(x, sync_grads=True).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0, 1.0, 1.0]


def test_fabric_clip_gradients_third_positional_argument_is_clip_val() -> None:
    fabric = L.Fabric(accelerator="cpu")
    model = fabric.setup(nn.Linear(3, 1))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.full((2, 3), 100.0)).sum())
    fabric.clip_gradients(model, opt, 0.5)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert float(grads.abs().max()) == 0.5  # by value: every component clamped, not the norm scaled


def test_fabric_setup_move_to_device_and_refusals(tmp_path: Any) -> None:
    fabric = L.Fabric(accelerator="cpu")
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    wrapped = fabric.setup(nn.Linear(2, 2), move_to_device=False)
    assert wrapped.weight.device.type == "cpu"
    assert meta.weight.device.type == "meta"
    with pytest.raises(MisconfigurationError, match=r"filter="):
        fabric.save(tmp_path / "x.ckpt", {"m": wrapped}, filter={"m": lambda k, v: True})
    fabric.save(tmp_path / "x.ckpt", {"m": wrapped})
    assert fabric.load(tmp_path / "x.ckpt", {"m": wrapped}, weights_only=False) == {}  # trusted-file opt-in
    assert fabric.launch(lambda f, a, b=0: a + b, 2, b=3) == 5


def test_lightning_module_in_a_fabric_loop_logs_through_fabric() -> None:
    rows: list[Any] = []

    class Log(L.loggers.Logger):
        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            rows.append(dict(metrics))

    class Manual(Net):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.log("loss", loss)
            return loss

    fabric = L.Fabric(accelerator="cpu", loggers=Log())
    model = Manual()
    module, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.logger is fabric.logger and model.fabric is fabric and model.optimizers() is optimizer
    before = flat(model).clone()
    for batch_idx, batch in enumerate(DataLoader(data(16), batch_size=8)):
        module.training_step(batch, batch_idx)
    assert len(rows) == 2 and "loss" in rows[0] and not torch.equal(before, flat(model))
    assert model.all_gather(torch.ones(2)).shape == (1, 2)


def test_seed_everything_returns_the_seed_and_reads_the_environment_default(monkeypatch: Any) -> None:
    # Deliberate difference (docs/porting.md): Lightning writes PL_GLOBAL_SEED; phalanx keeps no state in the
    # environment (samplers agree through a broadcast at setup) but, like Lightning, reads it as the default.
    monkeypatch.delenv("PHALANX_SEED", raising=False)
    assert L.seed_everything(7, verbose=False) == 7 and "PHALANX_SEED" not in os.environ
    monkeypatch.setenv("PHALANX_SEED", "11")
    assert L.seed_everything(verbose=False) == 11
