"""Hugging Face transformers in the suite: a small GPT-2 built from a config (never downloaded) as
student and teacher in an ``nn.ModuleDict`` distillation, the teacher frozen, both called directly
(``model.student(x)``, ``model["teacher"](x)``): under DDP and under FSDP, 2 ranks equal one process
on the concatenated batches. And under FSDP, the hint for a submodule called directly names the
class that works (GPT2LMHeadModel, which holds both tied weights), not an inner layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from mp import run_job
from run_if import run_if
from torch import nn

pytestmark = [pytest.mark.timeout(300), run_if(module="transformers")]

VOCAB, SEQ = 64, 12


def gpt2(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # dropout off
    torch.manual_seed(seed)
    model: nn.Module = GPT2LMHeadModel(config)
    return model


def make_pair() -> nn.ModuleDict:
    model = nn.ModuleDict({"teacher": gpt2(0), "student": gpt2(1)})
    model["teacher"].requires_grad_(False)
    return model


def tokens(n: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(2))


def distill_loss(model: Any, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        target = model["teacher"](x).logits.softmax(-1)
    log_probs = model.student(x).logits.log_softmax(-1)
    return nn.functional.kl_div(log_probs, target, reduction="batchmean")


def train_single(steps: int = 3) -> nn.ModuleDict:
    model = make_pair()
    opt = torch.optim.Adam(model["student"].parameters(), lr=1e-3)
    x = tokens()
    for step in range(steps):
        opt.zero_grad()
        distill_loss(model, x[step * 8 : step * 8 + 8]).backward()
        opt.step()
    return model


JOB = """
import sys, torch, phalanx
from mp import report
from tests.integration.test_transformers import distill_loss, make_pair, tokens

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=sys.argv[1])
fabric.launch()
model = make_pair()
model, opt = fabric.setup(model, torch.optim.Adam(model["student"].parameters(), lr=1e-3))
x, r = tokens(), fabric.global_rank
for step in range(3):
    opt.zero_grad()
    fabric.backward(distill_loss(model, x[step * 8 + 4 * r : step * 8 + 4 * r + 4]))
    opt.step()
full = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).double()
        for p in model.student.parameters()]
teacher_grads = [p.grad for p in model.teacher.parameters()]
report(fabric, student=torch.cat(full), teacher_untouched=all(g is None for g in teacher_grads))
"""

STRATEGIES = ["ddp", pytest.param("fsdp", marks=run_if(fsdp=True))]


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


HINT_JOB = """
import re, torch, phalanx
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2LMHeadModel
from phalanx.utils.errors import MisconfigurationError
from phalanx.strategies import FSDPStrategy
from mp import report
from tests.integration.test_transformers import gpt2, tokens


class Distill(nn.Module):  # a model with a forward: the root is a sharded unit
    def __init__(self):
        super().__init__()
        self.teacher, self.student = gpt2(0), gpt2(1)
        self.teacher.requires_grad_(False)

    def forward(self, x):
        return self.student(x).logits


def attempt(policy):
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy=eval(policy)))
    fabric.launch()
    model = Distill()
    try:
        model, opt = fabric.setup(model, torch.optim.SGD(model.student.parameters(), lr=0.1))
        fabric.backward(model.student(tokens()[:2]).logits.pow(2).mean())
        opt.step()
        return fabric, None
    except MisconfigurationError as err:
        return fabric, str(err)


# The default policy; then exactly the policy its error tells the user to write (one process set for all
# three attempts: each pays GPT-2's import and two ranks' start-up otherwise); then the inner layer.
fabric, first = attempt("None")
found = re.search(r"FSDPStrategy\\(auto_wrap_policy=(\\{[^}]*\\})\\)", first or "")
hint = found.group(1) if found else None
hinted = attempt(hint)[1] if hint else "no hint to follow"
fabric, layer = attempt("{nn.Embedding}")
report(fabric, first=first, hint=hint, hinted=hinted, layer=layer)
"""


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
