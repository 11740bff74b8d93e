from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# ---------------------------------------------------------------- fault-suite table (tests/test_faults.py)
# Each fault test records (scenario, expected, observed, seconds to detection); the table is printed
# at the end of the run, so a reader sees how fast every failure was reported.
FAULT_ROWS = pytest.StashKey[list[tuple[str, str, str, str]]]()


@pytest.fixture
def fault_log(request: pytest.FixtureRequest) -> Callable[[str, str, str, float | None], None]:
    rows = request.config.stash.setdefault(FAULT_ROWS, [])

    def record(scenario: str, expected: str, observed: str, seconds: float | None) -> None:
        rows.append((scenario, expected, observed, "-" if seconds is None else f"{seconds:.1f}"))

    return record


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    rows = config.stash.get(FAULT_ROWS, [])
    if not rows:
        return
    header = ("scenario", "expected", "observed", "s to detect")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    terminalreporter.section("fault suite")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        terminalreporter.write_line("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
