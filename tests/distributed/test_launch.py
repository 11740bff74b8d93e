"""Joining jobs started by other launchers: torchrun, and SLURM (simulated with its environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from job_runner import JOB_PYTHONPATH, JOBS, free_port, run_job

pytestmark = pytest.mark.timeout(150)

REPORT_SCRIPT = JOBS / "report_ranks.py"


def test_torchrun_job_is_joined(tmp_path: Path) -> None:
    job = run_job(
        REPORT_SCRIPT, tmp_path,
        command=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    ).check()
    assert job.reports[0]["total"] == job.reports[1]["total"] == 3.0
    assert job.reports[1]["ranks"] == [1, 1, 0, 2]


def test_slurm_job_is_joined(tmp_path: Path) -> None:
    """Two tasks started the way srun starts them: only SLURM_* variables, rank 0 hosts the store."""
    (tmp_path / "job.py").write_text(REPORT_SCRIPT.read_text())
    (tmp_path / "reports").mkdir()
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
        env.update({
            "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
            "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train",
            "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(port),
            "PHALANX_TEST_OUT": str(tmp_path / "reports"), "PYTHONPATH": JOB_PYTHONPATH,
        })
        procs.append(subprocess.Popen([sys.executable, "job.py"], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    reports = {r: json.loads((tmp_path / "reports" / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert reports[0]["total"] == reports[1]["total"] == 3.0
    assert reports[1]["ranks"] == [1, 1, 0, 2]


def test_slurm_allocation_that_does_not_match_devices_fails_fast(tmp_path: Path) -> None:
    job = run_job(
        REPORT_SCRIPT, tmp_path,
        env={"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NAME": "train"},
        timeout=60,
    )
    assert job.returncode != 0
    assert "The code asks for devices=2, num_nodes=1 (2 processes), but slurm started 1 process(es)" in job.stderr
    assert "--ntasks-per-node=2" in job.stderr


def test_phalanx_run_two_nodes_on_one_machine(tmp_path: Path) -> None:
    """`phalanx run --num-nodes 2` on each "node" forms one job, as torchrun's multi-node does."""
    (tmp_path / "job.py").write_text(REPORT_SCRIPT.read_text())
    (tmp_path / "reports").mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PHALANX_"))}
    env.update({"PHALANX_TEST_OUT": str(tmp_path / "reports"), "PYTHONPATH": JOB_PYTHONPATH})
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "phalanx.cli", "run", "--devices", "1", "--num-nodes", "2", "--node-rank",
             str(node), "--main-address", "127.0.0.1", "--main-port", str(port), "job.py", "2"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in (0, 1)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    reports = {r: json.loads((tmp_path / "reports" / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert reports[0]["total"] == reports[1]["total"] == 3.0
    assert sorted(tuple(reports[r]["ranks"]) for r in (0, 1)) == [(0, 0, 0, 2), (1, 0, 1, 2)]
