"""Lightning semantics on 2 real ranks (gloo): Fabric collectives of numbers, bools and tensors with
gradients, ranks known before launch under `phalanx run`, a Trainer that starts its processes at
fit (not at construction), and manual optimization under DDP equal to one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from mp import run_job
from run_if import run_if

pytestmark = pytest.mark.timeout(300)

COLLECTIVES_JOB = """
import torch, phalanx as L
from mp import report

fabric = L.Fabric(accelerator="cpu", devices=2)
fabric.launch()
r = fabric.global_rank
t = torch.tensor([float(r + 1)])
returned = fabric.all_reduce(t, reduce_op="sum")
x = torch.full((2,), float(r + 1), requires_grad=True)
gathered = fabric.all_gather(x, sync_grads=True)
# Every rank's loss uses every rank's slice; x.grad must sum the contributions of all ranks' losses.
weights = torch.tensor([[1.0], [10.0]])
((gathered * weights).sum() * (r + 1)).backward()
report(fabric, numbers=fabric.all_gather(r + 1), bools=fabric.all_gather(r == 0).tolist(),
       in_place=t, same_object=returned is t, mean_of_ints=fabric.all_reduce(r + 1),
       max_enum=fabric.all_reduce(float(r), reduce_op=torch.distributed.ReduceOp.MAX),
       gathered=gathered.detach(), grad=x.grad, nested=fabric.all_gather({"a": [r, 2.5]})["a"][0])
"""


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


RANKS_JOB = """
import phalanx as L
from mp import report

fabric = L.Fabric(accelerator="cpu", devices=2)
trainer = L.Trainer(accelerator="cpu", devices=2, logger=False)
before = (fabric.global_rank, fabric.world_size, fabric.local_rank, trainer.global_rank, trainer.is_global_zero)
fabric.launch()
report(fabric, before=before, after=(fabric.global_rank, fabric.world_size))
"""


def test_ranks_are_known_right_after_construction_under_phalanx_run(tmp_path: Path) -> None:
    job = run_job(RANKS_JOB, tmp_path, command=[sys.executable, "-m", "phalanx.cli", "run", "--devices", "2"]).check()
    assert job.reports[0]["before"] == [0, 2, 0, 0, True] and job.reports[1]["before"] == [1, 2, 1, 1, False]
    assert job.reports[1]["after"] == [1, 2]


LAUNCH_AT_FIT_JOB = """
import os, sys, torch, phalanx as L
from pathlib import Path
from mp import report
from tests.integration.test_porting import TwoOptimizers, data, flat
from torch.utils.data import DataLoader

trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
# Reached by the original process too: constructing the Trainer started nothing.
Path(f"constructed-{os.environ.get('RANK', 'parent')}").touch()
model = TwoOptimizers()
trainer.fit(model, DataLoader(data(24), batch_size=4))
report(trainer.fabric, params=flat(model), steps=trainer.global_step,
       metrics={k: float(v) for k, v in trainer.callback_metrics.items()})
"""


def test_trainer_launches_at_fit_and_manual_optimization_under_ddp_equals_one_process(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from tests.integration.test_porting import TwoOptimizers, data, flat, manual_reference

    job = run_job(LAUNCH_AT_FIT_JOB, tmp_path).check()
    assert sorted(p.name for p in tmp_path.glob("constructed-*")) == ["constructed-0", "constructed-1",
                                                                       "constructed-parent"]
    # Two ranks with batch 4 are one process with batch 8 (gradients averaged; the losses are means).
    reference = manual_reference(list(DataLoader(data(24), batch_size=8)))
    for rank in (0, 1):
        assert job.reports[rank]["steps"] == 6
        assert torch.allclose(torch.tensor(job.reports[rank]["params"]).double(), flat(reference).double(), atol=1e-6)
    del TwoOptimizers


FSDP_EVAL_JOB = """
import phalanx
from mp import report
from trainer_support import Regressor, loader

trainer = phalanx.Trainer(accelerator="cpu", devices=2, strategy="fsdp", max_epochs=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = Regressor(optimizer="adam", lr=0.01)
trainer.fit(model, loader(32, 4), loader(16, 4))  # sanity check + validation every epoch, inference_mode=True
report(trainer.fabric, steps=trainer.global_step, val=trainer.validate(model, loader(16, 4), verbose=False))
"""


@run_if(fsdp=True)
def test_fsdp_evaluates_between_training_steps_with_the_default_inference_mode(tmp_path: Path) -> None:
    # torch.inference_mode would leave FSDP's reused all-gather buffers as inference tensors, and the
    # next training step fails ("Inplace update to inference tensor outside InferenceMode").
    job = run_job(FSDP_EVAL_JOB, tmp_path).check()
    assert job.reports[0]["steps"] == 8 and job.reports[0]["val"] == job.reports[1]["val"]
