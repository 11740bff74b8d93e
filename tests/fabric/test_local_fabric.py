"""A one-process Fabric inside a running multi-process job: local work on one rank, as Lightning allows.

LitGPT's ``finetune_lora`` ends with ``merge_lora`` on rank 0, which builds ``Fabric(devices=1,
accelerator="cpu")`` inside the 2-process job. As the *first* Fabric of a launched job, ``devices=1`` is
still refused (``torchrun --nproc-per-node 2`` around it would train two copies silently); created while
a phalanx Fabric runs the job, it is a deliberate local Fabric: rank 0 of 1, collectives that are the
identity, a barrier that waits for no one, single-process checkpoint I/O, and a teardown that leaves the
job's process group alone. One real 2-rank gloo job checks both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from job_runner import JOBS, run_job

pytestmark = pytest.mark.timeout(180)

JOB = JOBS / "local_fabric.py"


@pytest.mark.parametrize("launch", ["script", "cli"])
def test_local_fabric_on_one_rank_inside_a_two_process_job(tmp_path: Path, launch: str) -> None:
    # cli: `phalanx run --devices 2`, whose flag must not turn the local Fabric into a second job Fabric
    command = [sys.executable, "-m", "phalanx.cli", "run", "--devices", "2"] if launch == "cli" else None
    job = run_job(JOB, tmp_path, timeout=150, env={"PHALANX_GUARD_TIMEOUT": "20"}, command=command,
                  args=(launch,)).check()
    assert sorted(job.reports) == [0, 1], job.output[-3000:]
    for out in job.reports.values():
        if launch == "script":
            # The first Fabric of the job asks for one process where two were launched: refused, naming the fix.
            refused = "asks for devices=1, num_nodes=1 (1 processes), but torchelastic started 2 process(es)"
            assert refused in out["refused"], out
        assert out["group_alive"] and out["params_equal"] and out["job_ckpt"], out
        assert out["sum"] == 3.0, out
    local = job.reports[0]
    assert local["before_launch"] == [0, 1, True]
    assert local["after_setup"] == [0, 1, "single"]
    assert local["all_reduce"] == 3.0 and local["all_gather"] == [1, 2] and local["broadcast"] == "mine"
    assert local["loaded_back"] and local["rest"] == {"step": 7} and local["file"]
