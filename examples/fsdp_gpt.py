"""A small character-level GPT trained with FSDP on 2 CPU processes.

    python examples/fsdp_gpt.py            # about a minute on 2 CPU cores

The text is Python's own help pages (``pydoc_data.topics``, shipped with every CPython), so nothing
is downloaded. The script shows the FSDP workflow end to end: the model is created on the meta
device (``empty_init``) and each rank materializes only its shards; every ``Block`` of the
``nn.ModuleList`` becomes its own sharded unit; gradients are clipped by the global norm; the run
ends with a sharded checkpoint that ``phalanx consolidate`` turns into one plain file.
"""

from __future__ import annotations

import argparse
import math
import time
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.strategies import FSDPStrategy


class Block(nn.Module):
    """Pre-norm Transformer block: causal self-attention and an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, d: int = 128, layers: int = 3, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--checkpoint", default="fsdp_gpt_ckpt")
    args = parser.parse_args()

    torch.set_num_threads(1)  # two processes share the CPU cores
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy())
    fabric.launch()
    fabric.seed_everything(1234)

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]

    def batch(source: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(source) - args.context - 1, (args.batch_size,), generator=gen)
        x = torch.stack([source[s : s + args.context] for s in starts])
        y = torch.stack([source[s + 1 : s + args.context + 1] for s in starts])
        return x, y

    with fabric.init_module(empty_init=True):  # meta device: no memory until setup shards it
        model = GPT(len(chars), args.context)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    n_params = sum(p.numel() for p in model.parameters())
    fabric.print(f"{n_params / 1e6:.2f} M parameters, {len(chars)} characters, {len(train):,} training tokens")

    gen = torch.Generator().manual_seed(1000 + fabric.global_rank)  # each rank draws different batches
    start = time.time()
    for step in range(1, args.steps + 1):
        x, y = batch(train, gen)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad()
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        if step % 25 == 0 or step == 1:
            mean_loss = fabric.all_reduce(loss.detach())
            fabric.print(f"step {step:4d}  train loss {mean_loss.item():.3f}  ({time.time() - start:.0f}s)")

    model.eval()
    val_gen = torch.Generator().manual_seed(7 + fabric.global_rank)
    with torch.no_grad():
        losses = []
        for _ in range(8):
            x, y = batch(val, val_gen)
            logits = model(x)
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        val_loss = fabric.all_reduce(torch.stack(losses).mean()).item()
        # Sampling runs on every rank (each forward is collective) with the same generator.
        sample_gen = torch.Generator().manual_seed(0)
        idx = torch.tensor([[chars.index("T")]])
        for _ in range(120):
            probs = F.softmax(model(idx[:, -args.context :])[0, -1] / 0.8, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=sample_gen)[None]], dim=1)
    fabric.print(f"validation loss {val_loss:.3f} (perplexity {math.exp(val_loss):.1f}); sample:")
    fabric.print("".join(chars[i] for i in idx[0].tolist()))

    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": args.steps})
    fabric.print(f"saved {args.checkpoint}/ (sharded); one file: phalanx consolidate {args.checkpoint} gpt.pt")


if __name__ == "__main__":
    main()
