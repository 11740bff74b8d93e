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

import pytest
import torch
from mp import JOBS, run_job
from torch import nn

from phalanx.utils.compat import FSDP_ON_CPU
from phalanx.utils.init import materialize_meta_tensors

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not FSDP_ON_CPU, reason="FSDP2 runs on CPU from torch 2.7")]

MODEL_CODE = '''
import math
import torch
from torch import nn


class LoRALinear(nn.Module):
    """LitGPT's LoRA layer in small: lora_A drawn (kaiming), lora_B zero; the base Linear its own module."""

    def __init__(self, d_in, d_out, r=3):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.lora_A = nn.Parameter(torch.empty(r, d_in))
        self.lora_B = nn.Parameter(torch.empty(d_out, r))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x):
        return self.linear(x) + x @ self.lora_A.T @ self.lora_B.T


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList([LoRALinear(6, 6), LoRALinear(6, 6)])
        self.norm = nn.BatchNorm1d(6)  # parameters and buffers
        self.head = nn.Linear(6, 5)  # 5 rows over 2 ranks: uneven shards

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))
'''

JOB = JOBS / "meta_init.py"


def single_process() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What one process gets: the same meta model, seed 5, materialized module by module."""
    scope: dict[str, object] = {}
    exec(MODEL_CODE, scope)
    torch.manual_seed(5)
    with torch.device("meta"):
        net = scope["Net"]()  # type: ignore[operator]
    assert isinstance(net, nn.Module)
    materialize_meta_tensors(net, "cpu")
    full = {n: t.detach() for n, t in [*net.named_parameters(), *net.named_buffers()]}
    return full, torch.rand(3)


@pytest.mark.parametrize(("devices", "names"), [
    (2, ("fsdp", "litgpt", "tp")),
    pytest.param(4, ("2x2",), marks=pytest.mark.slow),  # 4 processes: the slow tier
])
def test_sharded_meta_init_equals_one_process(tmp_path: Path, devices: int, names: tuple[str, ...]) -> None:
    (tmp_path / "models.py").write_text(MODEL_CODE)
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
