"""The run folder's two files, one process: the claim that refuses a second run (and carries a run's start over to
its restarted attempt), and the record of a preempted run."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from phalanx.distributed.runfolder import CLAIM, PreemptedRun, RunClaim
from phalanx.utils.errors import MisconfigurationError


def test_a_second_claim_is_refused_naming_the_holder_until_it_lets_go(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    first = RunClaim(folder)  # creates the folder
    held = json.loads((folder / CLAIM).read_text())
    assert held["pid"] == os.getpid() and held["resumed_from"] is None
    with pytest.raises(MisconfigurationError, match=re.escape(
            f"Another Trainer of this process (pid {os.getpid()}) is fitting in {folder}: two runs in one folder would "
            "overwrite each other's checkpoints and logs and resume each other's state. Give this run its own folder "
            "(Trainer(default_root_dir=...), the main job's --out), or wait until the other run ends.")):
        RunClaim(folder)  # flock locks an open file, so a second one in the same process conflicts too
    first.release()
    assert not (folder / CLAIM).exists()  # a run that ended well leaves nothing behind
    RunClaim(folder).release()


def test_a_restarted_attempt_of_the_same_run_keeps_its_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "phalanx-1")
    first = RunClaim(tmp_path)
    first.resumed_from(tmp_path / "last.ckpt")
    started = first.record.started
    first.release(ended_well=False)  # a failed attempt keeps its record
    again = RunClaim(tmp_path, restarted=True)
    assert (again.record.started, again.record.resumed_from) == (started, str(tmp_path / "last.ckpt"))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")  # one that ended well too, while a restart may follow
    again.release()
    assert (tmp_path / CLAIM).exists()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "phalanx-2")  # another run's attempt: its own start, nothing resumed
    other = RunClaim(tmp_path, restarted=True)
    assert other.record.started > started and other.record.resumed_from is None
    other.release()


def test_the_record_of_a_preempted_run(tmp_path: Path) -> None:
    assert PreemptedRun.read(tmp_path) is None
    run = PreemptedRun.now(tmp_path / "ckpts" / "last.ckpt", 7, "SIGTERM on rank 1")
    run.write(tmp_path)
    assert PreemptedRun.read(tmp_path) == run and run.is_checkpoint(tmp_path / "ckpts" / ".." / "ckpts" / "last.ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["preempted.json"]  # written atomically: no temporary left
    PreemptedRun.path(tmp_path).write_text("{")
    with pytest.raises(MisconfigurationError, match=r"preempted.json \(the record of a preempted run\) cannot be read"):
        PreemptedRun.read(tmp_path)
    PreemptedRun.remove(tmp_path)
    PreemptedRun.remove(tmp_path)  # removing what is gone is fine
    assert PreemptedRun.read(tmp_path) is None
