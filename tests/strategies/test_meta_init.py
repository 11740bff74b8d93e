"""Meta-device init under sharding equals one process: ``fabric.init_module(empty_init=True)`` + ``setup`` on 2
ranks gives the full parameters and buffers that one process gets materializing the same meta model with the
same seed (``to_empty`` + ``reset_parameters()`` per module, in module order), and leaves the random state
where that process leaves it.

LitGPT's ``finetune_lora`` relies on it on several processes: ``lora_A`` is in no checkpoint, so its
initialization is what the run trains from. One real 2-rank gloo job covers FSDPStrategy (default units),
ModelParallelStrategy as LitGPT builds it (``fully_shard`` on every trainable Linear over 2 data-parallel
ranks) and a tensor-parallel split (Colwise / Rowwise, uneven rows), each through a new Fabric in the same
processes.
"""

from __future__ import annotations

import math
from pathlib import Path

import meta_init_models
import pytest
import torch
from job_runner import JOBS, run_job
from torch import nn

from phalanx.utils.compat import FSDP_ON_CPU
from phalanx.utils.init import materialize_meta_tensors

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not FSDP_ON_CPU, reason="FSDP2 runs on CPU from torch 2.7")]


JOB = JOBS / "meta_init.py"


def single_process() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What one process gets: the same meta model, seed 5, materialized module by module."""
    torch.manual_seed(5)
    with torch.device("meta"):
        net = meta_init_models.Net()
    assert isinstance(net, nn.Module)
    materialize_meta_tensors(net, "cpu")
    full = {n: t.detach() for n, t in [*net.named_parameters(), *net.named_buffers()]}
    return full, torch.rand(3)


@pytest.mark.parametrize(("devices", "names"), [
    (2, ("fsdp", "litgpt", "tp")),
    pytest.param(4, ("2x2",), marks=pytest.mark.slow),  # 4 processes: the slow tier
])
def test_sharded_meta_init_equals_one_process(tmp_path: Path, devices: int, names: tuple[str, ...]) -> None:
    job = run_job(JOB, tmp_path, timeout=150, args=(str(devices), *names)).check()
    expected, next_draw = single_process()
    bound = 1 / math.sqrt(6)  # kaiming_uniform_(a=sqrt(5)) on fan_in 6
    assert 0 < expected["blocks.0.lora_A"].abs().max() <= bound
    for name in names:
        for rank in range(devices):
            got = job.reports[rank][name]
            assert len(got["sharded"]) >= 2, (name, got["sharded"])  # the check is about sharded tensors
            assert sorted(got["full"]) == sorted(expected), name
            for key, want in expected.items():
                value = torch.tensor(got["full"][key], dtype=torch.float64)
                # bit for bit: float32 values survive the float64 report exactly
                assert torch.equal(value, want.double()), (name, rank, key, value, want)
            # The materialization drew what one process draws, no more and no less.
            assert torch.equal(torch.tensor(got["next_draw"], dtype=torch.float64), next_draw.double()), name
