"""The logger contract: a ``Logger`` subclass that writes only ``log_metrics`` works everywhere (its other methods
do nothing), anything else is refused when the Fabric or Trainer is built, and Fabric's ``Logging`` is the one
caller of the lifecycle: hyperparameters when a fit starts, ``finalize`` at each stage's end and the job's."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
from trainer_support import Regressor, loader, quiet

import phalanx
from phalanx.callbacks import ModelCheckpoint
from phalanx.loggers import CSVLogger, Logger, TensorBoardLogger
from phalanx.utils.errors import MisconfigurationError


class Recording(Logger):
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append(("metrics", step))

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("hparams", dict(vars(params) if isinstance(params, Namespace) else params)))

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.calls.append(("checkpoint", type(checkpoint_callback).__name__))

    def finalize(self, status: str = "success") -> None:
        self.calls.append(("finalize", status))


class Duck:
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...


def test_only_logger_subclasses_are_accepted() -> None:
    refused = r"loggers\[1\] is a Duck, not a phalanx.loggers.Logger. Subclass Logger"
    with pytest.raises(MisconfigurationError, match=refused):
        phalanx.Fabric(accelerator="cpu", loggers=[Recording(), Duck()])
    with pytest.raises(MisconfigurationError, match=refused):
        phalanx.Trainer(**quiet(logger=[Recording(), Duck()]))


def test_fabric_calls_the_lifecycle_and_defaults_do_nothing() -> None:
    class OnlyMetrics(Logger):
        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    recording = Recording()
    fabric = phalanx.Fabric(accelerator="cpu", loggers=[OnlyMetrics(), recording])
    fabric.log_hyperparams({"lr": 0.1})
    fabric.log("loss", 1.0, step=3)
    fabric.teardown()
    assert recording.calls == [("hparams", {"lr": 0.1}), ("metrics", 3), ("finalize", "success")]
    minimal = fabric.loggers[0]
    assert (minimal.name, minimal.version, minimal.log_dir, minimal.root_dir, minimal.experiment) == (None,) * 5


def test_each_trainer_stage_finalizes_once_through_fabric(tmp_path: Path) -> None:
    class Net(Regressor):
        def __init__(self, lr: float = 0.05) -> None:
            super().__init__(lr=lr, scheduler=False)
            self.save_hyperparameters()

    logger = Recording()
    trainer = phalanx.Trainer(max_epochs=1, default_root_dir=tmp_path, callbacks=[ModelCheckpoint(tmp_path)],
                              **quiet(logger=logger, enable_checkpointing=True))
    model = Net()
    trainer.fit(model, loader(8, 4))
    trainer.validate(model, loader(4, 4))
    events = [name for name, _ in logger.calls if name != "metrics"]
    assert events == ["hparams", "checkpoint", "checkpoint", "finalize", "finalize"]
    assert logger.calls[0] == ("hparams", {"lr": 0.05})
    assert [value for name, value in logger.calls if name == "finalize"] == ["success", "success"]


def test_file_loggers_name_their_version(tmp_path: Path) -> None:
    first, second = CSVLogger(tmp_path, name="exp"), CSVLogger(tmp_path, name="exp")
    first.log_hyperparams(Namespace(lr=0.1))  # creates version_0; Lightning's Namespace is accepted
    assert (first.name, first.version, second.version, first.save_dir) == ("exp", 0, 1, tmp_path)
    board = TensorBoardLogger(tmp_path, name="tb", version="run-a", sub_dir="events")
    assert board.version == "run-a" and board.log_dir == tmp_path / "tb" / "run-a" / "events"
