"""A Hugging Face model trained on the strategy in argv[1].

Run by tests/integration/test_transformers.py: test_gpt2_distillation_two_ranks_equal_one_process.
"""

import sys

import torch
from job_runner import report
from transformers_models import distill_loss, make_pair, tokens

import phalanx

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
