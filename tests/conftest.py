from __future__ import annotations

import importlib.util
import multiprocessing.process
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from run_if import run_if


# ---------------------------------------------------------------- the fast tier (`bash scripts/test.sh --fast`)
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="the edit-test loop: every test that starts a process skips where it would start it")


@pytest.fixture(autouse=True)
def _no_launches_in_the_fast_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Under ``--fast`` a test that starts a process (a job, a launcher, a CLI) is skipped at that point, so the
    tier holds exactly the tests that never launch, without a list to keep up to date."""
    if request.config.getoption("--fast"):
        def refuse(*args: Any, **kwargs: Any) -> None:
            pytest.skip("starts a process: not in the fast tier (bash scripts/test.sh runs it)")

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield


# ---------------------------------------------------------------- multi-process jobs (tests/support/job_runner.py)
@pytest.fixture()
def models(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The namespace of the test module's ``MODELS``, a file under tests/support whose models its jobs import too,
    run anew for each test (so that no module-level state passes from one test to the next), for the single-process
    references."""
    path = Path(request.module.MODELS)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered under its own name, as an import would: torch.compile looks functions' modules up by name.
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return vars(module)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs_cuda = run_if(cuda=True)  # ``@pytest.mark.gpu`` is shorthand for ``@run_if(cuda=True)``
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(needs_cuda)


# ---------------------------------------------------------------- fault-suite table (tests/distributed/test_faults.py)
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
