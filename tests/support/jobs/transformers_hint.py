"""A Hugging Face model whose misuse gets a hint.

Run by tests/integration/test_transformers.py: test_fsdp_direct_call_hint_names_a_class_that_works.
"""

import re
from typing import Any

import torch
from job_runner import report
from torch import nn
from transformers_models import gpt2, tokens

import phalanx
from phalanx.strategies import FSDPStrategy
from phalanx.utils.errors import MisconfigurationError


class Distill(nn.Module):  # a model with a forward: the root is a sharded unit
    def __init__(self) -> None:
        super().__init__()
        self.teacher, self.student = gpt2(0), gpt2(1)
        self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> Any:
        return self.student(x).logits


def attempt(policy: Any) -> Any:
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
found = re.search(r"FSDPStrategy\(auto_wrap_policy=(\{[^}]*\})\)", first or "")
hint = found.group(1) if found else None
hinted = attempt(hint)[1] if hint else "no hint to follow"
fabric, layer = attempt("{nn.Embedding}")
report(fabric, first=first, hint=hint, hinted=hinted, layer=layer)
