"""Seed 000's structure under FSDP: a plain ``nn.ModuleDict({"teacher", "student"})`` with a frozen
teacher, both called directly. ``fully_shard`` refuses a container without forward (the user got a raw
ValueError and a page of module print); phalanx shards the children as units and leaves the container
unsharded. 2 ranks equal one process on the concatenated batches; accumulation and checkpoints work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_container_models import loss_of, make_data, make_model
from job_runner import JOBS, REPO, run_job
from run_if import run_if

pytestmark = [
    pytest.mark.timeout(300),
    run_if(fsdp=True),
]


JOB = JOBS / "fsdp_container.py"


@pytest.mark.slow  # CI: test_distillation_example_runs_under_fsdp_and_matches_ddp (the same container path)
def test_module_dict_distillation_under_fsdp_equals_one_process(tmp_path: Path) -> None:
    job = run_job(JOB, tmp_path).check()
    model = make_model()
    opt = torch.optim.Adam(model["student"].parameters(), lr=0.01)
    x = make_data()
    for step in range(3):  # one process: each window is 16 samples, in two micro-batches of 8
        for micro in range(2):
            start = step * 16 + micro * 8
            (loss_of(model, x[start : start + 8]) / 2).backward()
        opt.step()
        opt.zero_grad()
    student = torch.cat([p.detach().reshape(-1).double() for p in model["student"].parameters()])
    teacher = torch.cat([p.detach().reshape(-1).double() for p in model["teacher"].parameters()])
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["sharded"] == ["DTensor"] * 4  # the student is a sharded unit
        torch.testing.assert_close(torch.tensor(rep["student"], dtype=torch.float64), student, rtol=0, atol=1e-6)
        assert torch.equal(torch.tensor(rep["teacher"], dtype=torch.float64), teacher)  # frozen
        assert rep["reloaded"] == rep["student"]  # the sharded checkpoint round-trips the container


def test_distillation_example_runs_under_fsdp_and_matches_ddp(tmp_path: Path) -> None:
    sums = {}
    for strategy in ("ddp", "fsdp"):
        proc = subprocess.run([sys.executable, str(REPO / "examples" / "distillation.py"), "--strategy", strategy],
                              cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = re.search(r"student checksum ([0-9.]+) \(" + strategy + r"\)", proc.stdout)
        assert found is not None, proc.stdout[-2000:]
        sums[strategy] = float(found.group(1))
    assert sums["fsdp"] == pytest.approx(sums["ddp"], rel=1e-6)
