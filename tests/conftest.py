from __future__ import annotations

import multiprocessing.process
import subprocess
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


# ---------------------------------------------------------------- multi-process jobs (tests/support/mp.py)
@pytest.fixture()
def models(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """The test module's model code for a job and its single-process reference: written to
    ``tmp_path/models.py`` (the job script, run with cwd=tmp_path, does ``from models import ...``) and
    executed here, returned as its namespace. The code is the module's ``JOB_MODELS`` or else ``MODEL_CODE``."""
    code = getattr(request.module, "JOB_MODELS", None) or request.module.MODEL_CODE
    (tmp_path / "models.py").write_text(code)
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    return namespace


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
