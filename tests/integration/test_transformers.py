"""Hugging Face transformers in the suite: a small GPT-2 built from a config (never downloaded) as
student and teacher in an ``nn.ModuleDict`` distillation, the teacher frozen, both called directly
(``model.student(x)``, ``model["teacher"](x)``): under DDP and under FSDP, 2 ranks equal one process
on the concatenated batches. And under FSDP, the hint for a submodule called directly names the
class that works (GPT2LMHeadModel, which holds both tied weights), not an inner layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from job_runner import JOBS, run_job
from run_if import run_if
from torch import nn
from transformers_models import distill_loss, make_pair, tokens

pytestmark = [pytest.mark.timeout(300), run_if(module="transformers")]


def train_single(steps: int = 3) -> nn.ModuleDict:
    model = make_pair()
    opt = torch.optim.Adam(model["student"].parameters(), lr=1e-3)
    x = tokens()
    for step in range(steps):
        opt.zero_grad()
        distill_loss(model, x[step * 8 : step * 8 + 8]).backward()
        opt.step()
    return model


JOB = JOBS / "transformers_fit.py"

# DDP distillation on direct submodule calls is CI's in tests/strategies/test_ddp.py; GPT-2 under DDP runs in slow.
STRATEGIES = [pytest.param("ddp", marks=pytest.mark.slow), pytest.param("fsdp", marks=run_if(fsdp=True))]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gpt2_distillation_two_ranks_equal_one_process(tmp_path: Path, strategy: str) -> None:
    job = run_job(JOB, tmp_path, args=(strategy,), timeout=240).check()
    expected = torch.cat([p.detach().reshape(-1).double() for p in train_single()["student"].parameters()])
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["teacher_untouched"]
        got = torch.tensor(rep["student"], dtype=torch.float64)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    assert job.reports[0]["student"] == job.reports[1]["student"]


HINT_JOB = JOBS / "transformers_hint.py"


@pytest.mark.slow  # a hint's wording; the FSDP distillation test above keeps transformers under FSDP in CI
@run_if(fsdp=True)
def test_fsdp_direct_call_hint_names_a_class_that_works(tmp_path: Path) -> None:
    """The hint used to name the first layer hit (student.transformer.wte, an Embedding); following it
    split GPT-2's tied embedding/output weights across units: a second error. Now it names the module
    that was called, and following the hint trains."""
    job = run_job(HINT_JOB, tmp_path, timeout=240).check()
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["first"].startswith("student (GPT2LMHeadModel) was called directly"), rep["first"]
        assert rep["hint"] == "{GPT2Block, GPT2LMHeadModel}", rep["first"]
        assert rep["hinted"] is None  # following the hint trains
        # Naming the inner layer instead (what the old hint led to) is refused with the tied-weights cause.
        assert "student.lm_head and student.transformer.wte share a parameter (tied weights)" in rep["layer"]
        assert "make student (GPT2LMHeadModel) the unit" in rep["layer"]
