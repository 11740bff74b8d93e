"""The strategy names (phalanx.strategies.registry): one table resolves, lists and lazily exports them."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from job_runner import JOBS

from phalanx.strategies import (
    DDPStrategy,
    ParallelStrategy,
    SingleDeviceStrategy,
    available_strategies,
    resolve_strategy,
)
from phalanx.strategies.registry import BACKENDS
from phalanx.utils.errors import MisconfigurationError


def test_every_listed_name_resolves_to_its_backend_with_the_arguments_it_implies() -> None:
    names = available_strategies()
    assert names[0] == "auto" and len(names) == len(set(names))
    for backend in BACKENDS:
        for name, kwargs in backend.names.items():
            assert name in names
            strategy = resolve_strategy(name, 1 if backend.one_process else 2)
            assert type(strategy).__name__ == backend.attr
            for key, value in kwargs.items():
                assert getattr(strategy, key, None) == value or strategy.ddp_kwargs[key] == value  # type: ignore[attr-defined]
    assert resolve_strategy("DeepSpeed_Stage_3", 2).stage == 3  # type: ignore[attr-defined]
    assert resolve_strategy("ddp_find_unused_parameters_true", 2).ddp_kwargs["find_unused_parameters"] is True  # type: ignore[attr-defined]
    assert isinstance(resolve_strategy("auto", 1), SingleDeviceStrategy)
    assert isinstance(resolve_strategy("auto", 4), DDPStrategy)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("name", ["ddp_spawn", "ddp_fork"])
def test_launcher_aliases_run_as_ddp_and_say_so(name: str) -> None:
    assert name in available_strategies()
    logger, records = logging.getLogger("phalanx"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        strategy = resolve_strategy(name, 2)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert type(strategy) is DDPStrategy
    assert strategy.ddp_kwargs["find_unused_parameters"] is False
    assert len(records.messages) == 1
    message = records.messages[0]
    assert f"strategy={name!r} runs as strategy='ddp'" in message and "Write strategy='ddp'" in message


def test_unknown_and_misplaced_names_are_refused_with_the_valid_ones() -> None:
    with pytest.raises(MisconfigurationError) as err:
        resolve_strategy("horovod", 2)
    assert "Unknown strategy 'horovod'" in str(err.value)
    assert all(repr(name) in str(err.value) for name in available_strategies())
    with pytest.raises(MisconfigurationError, match="runs one process, but devices\\*num_nodes=2"):
        resolve_strategy("single_device", 2)
    with pytest.raises(MisconfigurationError, match="must be a string or a phalanx Strategy instance"):
        resolve_strategy(3, 2)  # type: ignore[arg-type]
    instance = DDPStrategy()
    assert resolve_strategy(instance, 2) is instance


def test_process_group_backend_is_read_only_and_follows_device_and_backend() -> None:
    strategy = resolve_strategy("ddp", 2)
    assert isinstance(strategy, ParallelStrategy)
    assert strategy._process_group_backend == "gloo"
    strategy.device_type = "cuda"
    assert strategy._process_group_backend == "nccl"
    assert DDPStrategy(backend="gloo")._process_group_backend == "gloo"
    with pytest.raises(AttributeError):
        strategy._process_group_backend = "mpi"  # type: ignore[misc]


def test_heavy_backends_are_imported_only_when_asked_for() -> None:
    subprocess.run([sys.executable, str(JOBS / "heavy_backends_imported_lazily.py")], check=True, timeout=120)
