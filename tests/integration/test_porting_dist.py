"""Lightning semantics on 2 real ranks (gloo): Fabric collectives of numbers, bools and tensors with
gradients, ranks known before launch under `phalanx run`, a Trainer that starts its processes at
fit (not at construction), and manual optimization under DDP equal to one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from job_runner import JOBS, run_job
from run_if import run_if

pytestmark = pytest.mark.timeout(300)

COLLECTIVES_JOB = JOBS / "porting_collectives.py"


def test_fabric_collectives_on_two_ranks(tmp_path: Path) -> None:
    job = run_job(COLLECTIVES_JOB, tmp_path).check()
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["numbers"] == [1.0, 2.0] and rep["bools"] == [True, False]
        assert rep["in_place"] == [3.0] and rep["same_object"] is True
        assert rep["mean_of_ints"] == 1.5 and rep["max_enum"] == 1.0
        assert rep["gathered"] == [[1.0, 1.0], [2.0, 2.0]] and rep["nested"] == [0.0, 1.0]
    # d(sum_k (k+1) * sum_r w_r x_r) / d x_r = w_r * (1 + 2)
    assert job.reports[0]["grad"] == [3.0, 3.0] and job.reports[1]["grad"] == [30.0, 30.0]


RANKS_JOB = JOBS / "porting_ranks.py"


def test_ranks_are_known_right_after_construction_under_phalanx_run(tmp_path: Path) -> None:
    job = run_job(RANKS_JOB, tmp_path, command=[sys.executable, "-m", "phalanx.cli", "run", "--devices", "2"]).check()
    assert job.reports[0]["before"] == [0, 2, 0, 0, True] and job.reports[1]["before"] == [1, 2, 1, 1, False]
    assert job.reports[1]["after"] == [1, 2]


LAUNCH_AT_FIT_JOB = JOBS / "porting_launch_at_fit.py"


def test_trainer_launches_at_fit_and_manual_optimization_under_ddp_equals_one_process(tmp_path: Path) -> None:
    from porting_models import TwoOptimizers, data, flat, manual_reference
    from torch.utils.data import DataLoader

    job = run_job(LAUNCH_AT_FIT_JOB, tmp_path).check()
    assert sorted(p.name for p in tmp_path.glob("constructed-*")) == ["constructed-0", "constructed-1",
                                                                       "constructed-parent"]
    # Two ranks with batch 4 are one process with batch 8 (gradients averaged; the losses are means).
    reference = manual_reference(list(DataLoader(data(24), batch_size=8)))
    for rank in (0, 1):
        assert job.reports[rank]["steps"] == 6
        assert torch.allclose(torch.tensor(job.reports[rank]["params"]).double(), flat(reference).double(), atol=1e-6)
    del TwoOptimizers


FSDP_EVAL_JOB = JOBS / "porting_fsdp_eval.py"


@pytest.mark.slow  # the same inference-mode evaluation under FSDP: test_combinations[fsdp-bf16-mixed]
@run_if(fsdp=True)
def test_fsdp_evaluates_between_training_steps_with_the_default_inference_mode(tmp_path: Path) -> None:
    # torch.inference_mode would leave FSDP's reused all-gather buffers as inference tensors, and the
    # next training step fails ("Inplace update to inference tensor outside InferenceMode").
    job = run_job(FSDP_EVAL_JOB, tmp_path).check()
    assert job.reports[0]["steps"] == 8 and job.reports[0]["val"] == job.reports[1]["val"]
