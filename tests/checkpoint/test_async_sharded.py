"""Asynchronous sharded saves (FSDPStrategy(async_save=True), inherited by ModelParallelStrategy): the
checkpoint holds the state as of the save call although training goes on during the write; the next
save/load waits for it; a failed background write or publish is raised on every rank with its true
cause and keeps the previous checkpoint; a process killed during the background write leaves the
previous checkpoint loadable."""

from __future__ import annotations

from pathlib import Path

import model_parallel_models
import pytest
import torch
from job_runner import JOBS, run_job
from killed_saves import kill_trial

from phalanx.checkpoint import read_everything
from phalanx.strategies import FSDPStrategy
from phalanx.utils.errors import MisconfigurationError

pytestmark = pytest.mark.timeout(300)

ROUND_TRIP_JOB = JOBS / "async_checkpoint_round_trip.py"


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_async_save_round_trip_and_failure(tmp_path: Path, strategy: str) -> None:
    job = run_job(ROUND_TRIP_JOB, tmp_path, timeout=240, args=(strategy,)).check()
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["handle"] == "AsyncCheckpoint" and rep["done"]
        assert torch.equal(torch.tensor(rep["loaded"]), torch.tensor(rep["at_save2"]))
        assert rep["step"] == 4
        # Rank 1's disk was full; torch tells every rank, and each raises the operating system's cause.
        cause = "Cannot write the shards of checkpoint ckpt: [Errno 28] No space left on device"
        assert rep["failure"] is not None and cause in rep["failure"], rep["failure"]
        assert "The previous checkpoint, if any, is unchanged." in rep["failure"]
        assert cause in rep["local_failure"]
        assert rep["step_after_failure"] == 4
        # Only rank 0 publishes; its failure reaches rank 1, which had nothing to fail.
        publish = "Cannot publish checkpoint ckpt: [Errno 30] Read-only file system"
        assert rep["publish_failure"] is not None and publish in rep["publish_failure"], rep["publish_failure"]
        assert ("failed on rank 0" in rep["publish_failure"]) == (rank == 1), rep["publish_failure"]
        assert (rep["local_publish_failure"] is not None) == (rank == 0)
        assert rep["step_after_publish_failure"] == 4
        assert rep["leftovers"] == []  # the unpublished directory was removed
        assert "Saving ckpt failed on rank 1: MemoryError: cannot allocate the staging copy" in rep["stage_failure"]
        assert rep["step_after_stage_failure"] == 4 and rep["leftovers_after_stage_failure"] == []
    assert job.reports[0]["published"]  # on rank 0, wait() returns once the checkpoint is in place
    # The first save holds the state as of the save call, although three steps ran during its write.
    first = read_everything(tmp_path / "first")
    assert first["step"] == 1
    plain = model_parallel_models.make_model()
    plain.load_state_dict(first["model"])
    assert torch.equal(model_parallel_models.full_params(plain),
                       torch.tensor(job.reports[0]["at_save"], dtype=torch.float64))
    saved_opt = torch.cat([first["optimizer"]["state"][i][k].reshape(-1).double()
                           for i in range(len(first["optimizer"]["state"])) for k in ("exp_avg", "exp_avg_sq", "step")])
    assert torch.equal(saved_opt, torch.tensor(job.reports[0]["opt_at_save"], dtype=torch.float64))
    assert job.reports[0]["at_save"] != job.reports[0]["at_save2"]


ASYNC = "fsdp_async"


def test_async_save_needs_sharded_checkpoints() -> None:
    with pytest.raises(MisconfigurationError, match="async_save=True writes sharded checkpoints"):
        FSDPStrategy(async_save=True, state_dict_type="full")


def test_kill_during_async_write_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    kill_trial(tmp_path, seed=0, strategy=ASYNC)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_kill_during_async_write_many_trials(tmp_path: Path) -> None:
    steps = [kill_trial(tmp_path / str(i), seed=200 + i, strategy=ASYNC) for i in range(8)]
    assert max(steps) > 1, steps  # kills landed after later saves began, not only before
