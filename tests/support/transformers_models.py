"""Hugging Face GPT-2 models and tokens of the transformers tests and of their jobs
(tests/integration/test_transformers.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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
