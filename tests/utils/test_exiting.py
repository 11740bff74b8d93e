"""A process that used phalanx skips the final cyclic garbage collection at exit (phalanx.utils.exiting):
checked where it happens, in the atexit handler that runs after phalanx's own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from job_runner import JOB_PYTHONPATH, JOBS, run_job


def test_freeze_at_exit_freezes_once_and_only_at_exit(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(JOBS / "freeze_at_exit_called_twice.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": JOB_PYTHONPATH, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "calls").read_text() == "1"
    assert int((tmp_path / "frozen-launcher").read_text()) > 100_000  # torch's objects: the collector skips them


@pytest.mark.timeout(180)
def test_launched_ranks_and_their_launcher_skip_the_final_collection(tmp_path: Path) -> None:
    job = run_job(JOBS / "freeze_at_exit_launched.py", tmp_path)
    job.check()
    counts = {p.name.removeprefix("frozen-"): int(p.read_text()) for p in tmp_path.glob("frozen-*")}
    assert set(counts) == {"0", "1", "launcher"}, counts
    assert min(counts.values()) > 100_000, counts
