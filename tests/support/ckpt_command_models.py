"""The MLP and the GPT-2 of the checkpoints that the phalanx ckpt tests write and read, in the test and in its jobs
(tests/cli/test_ckpt.py)."""

from __future__ import annotations

from typing import Any

import torch

VOCAB, SEQ = 64, 8


def gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


class Holder(torch.nn.Module):
    """A training module holding the Hugging Face model as ``self.model`` (its keys start with ``model.``)."""

    def __init__(self) -> None:
        from transformers import GPT2LMHeadModel

        super().__init__()
        torch.manual_seed(1)
        self.model = GPT2LMHeadModel(gpt2_config())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).logits  # type: ignore[no-any-return]


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(3))
