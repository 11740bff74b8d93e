"""Test data for tests/integration/test_litgpt_port.py, which runs LitGPT 0.5.13's own CLI (``python -m litgpt
pretrain|finetune_full|finetune_lora --config ...``) on Lightning and on phalanx.

Imported inside the venvs of scripts/litgpt_env.sh (where ``litgpt.data`` sits on Lightning or, in the port,
on phalanx), never by phalanx's own test environment:

    python litgpt_port_driver.py prepare WORK   # a character tokenizer, a text to pretrain on, SFT samples
    python litgpt_port_driver.py pretrain --config c.yaml   # `litgpt pretrain --config c.yaml`, optionally
                                                            # with LITGPT_TEST_STRATEGY=ddp (see force_strategy)

and ``TokenBlocks``, the pretraining DataModule a config names as ``litgpt_port_driver.TokenBlocks``.
"""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from litgpt.data import DataModule
from torch.utils.data import DataLoader

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega the a of and to in is was for on with as by at from").split()
SPECIALS = ["<unk>", "<s>", "</s>"]


def _chars() -> list[str]:
    return sorted({c for w in WORDS for c in w} | set(" .,:#\n") | set("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
                  | set("abcdefghijklmnopqrstuvwxyz0123456789"))


def prepare(work: Path) -> None:
    """A character-level tokenizer (tokenizers' BPE with no merges), text to pretrain on, and SFT samples."""
    from tokenizers import Tokenizer, decoders, models

    tok_dir = work / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + _chars())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
               "tokenizer_class": "PreTrainedTokenizerFast"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(special))
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(600)) + "."
    (work / "pretrain.txt").write_text(text)
    samples = [{"instruction": f"say {a}", "input": "", "output": f"{a} {b}"}
               for a, b in ((rng.choice(WORDS), rng.choice(WORDS)) for _ in range(24))]
    (work / "sft.json").write_text(json.dumps(samples))


@dataclass
class TokenBlocks(DataModule):
    """Pretraining data: pretrain.txt cut into blocks of ``max_seq_length + 1`` tokens, in file order."""

    path: Path
    tokenizer: Any = field(default=None, init=False, repr=False)
    batch_size: int = field(default=1, init=False, repr=False)
    seq_len: int = field(default=16, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__init__()

    def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int | None = None) -> None:
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.seq_len = max_seq_length or self.seq_len

    def setup(self, stage: str = "") -> None:
        ids = self.tokenizer.encode(self.path.read_text(), bos=False)
        n = ids.numel() // (self.seq_len + 1)
        blocks = ids[: n * (self.seq_len + 1)].reshape(n, self.seq_len + 1)
        n_val = 8  # a multiple of 2 ranks x the micro batch: every rank scores whole batches
        self.train_blocks, self.val_blocks = blocks[n_val:], blocks[:n_val]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_blocks, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_blocks, batch_size=self.batch_size, shuffle=False)


def force_strategy(name: str) -> None:
    """Run LitGPT with ``Fabric(strategy=name)`` whatever strategy its script builds: Lightning refuses FSDP on
    CPU, so the 2-process Lightning reference runs DDP (the same data split and averaged gradients) instead of
    the ``FSDPStrategy(...)`` litgpt.pretrain constructs for several devices. The package LitGPT imports as
    ``L`` (lightning, or phalanx in the port) gets a Fabric that swaps the strategy argument."""
    from litgpt import utils

    framework = sys.modules[utils.L.__name__]
    original = framework.Fabric

    class Fabric(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["strategy"] = name
            super().__init__(*args, **kwargs)

    framework.Fabric = Fabric


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"] and len(sys.argv) == 3:
        prepare(Path(sys.argv[2]))
    else:  # `litgpt_port_driver.py pretrain --config c.yaml` runs `litgpt pretrain --config c.yaml`
        if os.environ.get("LITGPT_TEST_STRATEGY"):
            force_strategy(os.environ["LITGPT_TEST_STRATEGY"])
        from litgpt.__main__ import main

        main()
