"""An optimizer over parameters of no set-up module is refused on every strategy. Under DDP a loss
through a second model that was never set up used to train each rank's copy of it separately, without
a word (FSDP refused it with its own message; now one check, in Fabric, for all)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from job_runner import JOBS, run_job
from run_if import run_if
from torch import nn

from phalanx import Fabric
from phalanx.utils.errors import MisconfigurationError

pytestmark = pytest.mark.timeout(240)

FIX = "Set up every model the optimizer trains"


def test_single_process_refuses_foreign_parameters() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    model, other = nn.Linear(3, 2), nn.Linear(3, 2)
    with pytest.raises(MisconfigurationError, match=r"SGD updates 2 parameters that are not part of Linear \(nor of "
                                                     rf"a model set up before\).*{FIX}"):
        fabric.setup(model, torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1))
    model = fabric.setup_module(model)
    with pytest.raises(MisconfigurationError, match=r"Adam updates 2 parameters that are not part of any model set "
                                                     "up with this Fabric"):
        fabric.setup_optimizers(torch.optim.Adam(other.parameters()))
    free = nn.Parameter(torch.ones(1))
    with pytest.raises(MisconfigurationError, match=r"SGD updates 1 parameter that is not part of"):
        fabric.setup_optimizers(torch.optim.SGD([*model.parameters(), free], lr=0.1))
    # Set up first, and the same optimizer is accepted.
    fabric.setup_module(other)
    fabric.setup_optimizers(torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1))


JOB = JOBS / "optimizer_ownership.py"

STRATEGIES = ["ddp", pytest.param("fsdp", marks=run_if(fsdp=True))]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_foreign_parameters_refused_on_two_ranks(tmp_path: Path, strategy: str) -> None:
    job = run_job(JOB, tmp_path, args=(strategy,)).check()
    for rank in (0, 1):
        errors = job.reports[rank]["errors"]
        assert len(errors) == 2 and all(e is not None for e in errors), errors
        assert errors[0].startswith("SGD updates 2 parameters that are not part of Linear (nor of a model set up "
                                    "before): phalanx would neither average their gradients across ranks nor shard "
                                    "them, so each rank would train its own copy.")
        assert "not part of any model set up with this Fabric" in errors[1] and FIX in errors[1]
