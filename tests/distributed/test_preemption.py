"""The pieces of preemption handling, one process: which signals, recording them, the agreement, the exit,
the SLURM requeue, and finding the newest complete checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from job_runner import JOBS

from phalanx.checkpoint import MARKER, latest
from phalanx.distributed.failures import preempted_summary
from phalanx.distributed.preemption import (
    EXIT_PREEMPTED,
    Preempted,
    PreemptionSignals,
    Stop,
    requeue_slurm_job,
    resolve_signals,
)
from phalanx.utils.errors import MisconfigurationError


def test_signals_default_to_sigterm_and_sigusr1_and_can_be_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_PREEMPTION_SIGNALS", raising=False)
    assert resolve_signals() == (signal.SIGTERM, signal.SIGUSR1)
    monkeypatch.setenv("PHALANX_PREEMPTION_SIGNALS", "usr2, SIGINT")
    assert resolve_signals() == (signal.SIGUSR2, signal.SIGINT)
    monkeypatch.setenv("PHALANX_PREEMPTION_SIGNALS", "none")
    assert resolve_signals() == ()
    assert resolve_signals(["SIGTERM", int(signal.SIGTERM)]) == (signal.SIGTERM,)
    with pytest.raises(MisconfigurationError, match=r"Unknown preemption signal 'SIGBOGUS': give signal names"):
        resolve_signals(["SIGBOGUS"])
    with pytest.raises(MisconfigurationError, match="SIGKILL cannot be caught"):
        resolve_signals(["KILL"])


def test_a_signal_is_only_recorded_and_the_previous_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    watch = PreemptionSignals(["SIGUSR1"])
    assert watch.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second one (e.g. during the final save) changes nothing
        deadline = time.monotonic() + 5
        while watch.count < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.received == signal.SIGUSR1 and watch.count == 2
    finally:
        watch.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_the_ranks_agree_on_the_signal_and_the_lowest_rank_that_got_it() -> None:
    # Three ranks; ranks 1 and 2 got SIGTERM. max over the ranks is what the all-reduce computes.
    votes: list[list[int]] = []
    for rank, got in ((0, None), (1, signal.SIGTERM), (2, signal.SIGTERM)):
        watch = PreemptionSignals(["SIGTERM"])
        watch.received = got
        watch.agree(rank, 3, lambda values: votes.append(values) or values)  # type: ignore[func-returns-value]
    agreed = [max(column) for column in zip(*votes)]
    quiet = PreemptionSignals(["SIGTERM"])
    assert quiet.agree(0, 3, lambda values: agreed) == Stop(signal.SIGTERM, 1)
    assert quiet.agree(0, 3, lambda values: [0, 0]) is None
    assert Stop(signal.SIGTERM, 1).describe() == "SIGTERM on rank 1"


def test_preempted_ends_the_process_with_75_and_no_traceback() -> None:
    done = subprocess.run([sys.executable, str(JOBS / "raise_preempted.py")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == EXIT_PREEMPTED == 75
    assert done.stderr == ""


def _scontrol(tmp_path: Path, exit_code: int) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\necho 'not requeueable' >&2\nexit {exit_code}\n")
    script.chmod(0o755)


def test_slurm_requeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert not requeue_slurm_job(said.append)  # not under SLURM: nothing to do, nothing said
    assert said == []
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    _scontrol(tmp_path, 0)
    assert requeue_slurm_job(said.append)
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert requeue_slurm_job(said.append)
    assert (tmp_path / "calls").read_text().split("\n")[:2] == ["requeue 77", "requeue 70_3"]
    _scontrol(tmp_path, 1)
    assert not requeue_slurm_job(said.append)
    assert "`scontrol requeue 70_3` failed with exit code 1: not requeueable" in said[-1]
    monkeypatch.setenv("PHALANX_SLURM_REQUEUE", "0")
    assert not requeue_slurm_job(said.append)


def test_latest_is_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    assert latest([tmp_path / "missing"]) is None
    old, new = tmp_path / "a.ckpt", tmp_path / "b"
    old.write_bytes(b"x")
    os.utime(old, (1000, 1000))
    new.mkdir()
    (new / MARKER).write_bytes(b"x")
    os.utime(new / MARKER, (2000, 2000))
    interrupted = tmp_path / "c"  # a directory without its marker: a save that did not finish
    interrupted.mkdir()
    hidden = tmp_path / ".d.ckpt.partial"  # a save in progress
    hidden.write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert latest([tmp_path]) == new
    assert latest([tmp_path], "*.ckpt") == old
    other = tmp_path / "other"
    other.mkdir()
    newest = other / "last.ckpt"
    newest.write_bytes(b"x")
    assert latest([tmp_path, other]) == newest


def test_the_launcher_reads_a_preempted_job_as_such() -> None:
    class Failure:
        def __init__(self, exitcode: int, message: str | None) -> None:
            self.exitcode, self.timestamp = exitcode, 0
            self.error_file_data: dict[str, Any] = {"message": {"message": message}} if message else {}

    class Err:
        failures = {0: Failure(75, "Preempted: preempted at step 5 by SIGTERM on rank 1; checkpoint: x"),
                    1: Failure(75, None)}

    assert preempted_summary(Err()) == "preempted at step 5 by SIGTERM on rank 1; checkpoint: x"
    Err.failures[1] = Failure(1, "KeyError: 'x'")  # a real failure is reported as one
    assert preempted_summary(Err()) is None
    assert isinstance(Preempted("m"), SystemExit) and str(Preempted("m")) == "m"


def test_an_op_without_a_call_site_is_described_without_an_empty_one() -> None:
    from phalanx.distributed.heartbeat import OpState

    unguarded = OpState(seq=17, name="stop_requested", phase="collective", site="", since=0.0)
    assert unguarded.here(1) == "stop_requested (collective #17, on rank 1)"
    guarded = OpState(seq=3, name="barrier", phase="rendezvous", site="job.py:7 (<module>)", since=0.0)
    assert guarded.here(0) == "barrier (collective #3, called at job.py:7 (<module>) on rank 0)"
