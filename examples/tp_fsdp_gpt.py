"""A small character-level GPT trained with 2-D parallelism on 4 CPU processes: a 2 x 2 device mesh,
tensor parallelism inside each model replica and FSDP across the two replicas.

    python examples/tp_fsdp_gpt.py            # a few minutes on 2 CPU cores

The text is Python's own help pages (``pydoc_data.topics``), so nothing is downloaded. What it shows:

* ``parallelize`` (below) is the whole recipe, in torch's own vocabulary: each block's attention
  heads and MLP are split over ``device_mesh["tensor_parallel"]`` (Megatron style: column-parallel
  in, row-parallel out, one all-reduce per sub-layer), then each block and the root are sharded
  over ``device_mesh["data_parallel"]`` with ``fully_shard``.
* The model is created on the meta device (``empty_init``); each rank allocates and initializes
  only its own shards, and phalanx makes the replicated shards agree across tensor-parallel peers.
* The two ranks of one tensor-parallel group read the *same* batch: batches are drawn per
  data-parallel rank (``fabric.strategy.distributed_sampler_kwargs()``), not per process.
* Gradients are clipped by the global norm over both mesh dimensions, and checkpoints are written
  asynchronously (``async_save=True``): ``fabric.save`` returns while the shards are written.
"""

from __future__ import annotations

import argparse
import math
import time
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import phalanx
from phalanx.strategies import ModelParallelStrategy


class Block(nn.Module):
    """Pre-norm Transformer block. Under tensor parallelism each rank holds ``heads / tp`` heads and a
    slice of the MLP, so shapes are computed from the local weights (``-1`` heads), never from config."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


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


def parallelize(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Tensor parallel within a replica, then FSDP across replicas (the order torch's 2-D recipe uses)."""
    plan = {
        "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "proj": RowwiseParallel(),
        "fc": ColwiseParallel(), "out": RowwiseParallel(),
    }
    assert isinstance(model, GPT)
    for block in model.blocks:
        parallelize_module(block, device_mesh["tensor_parallel"], plan)
        fully_shard(block, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="per data-parallel rank")
    parser.add_argument("--checkpoint", default="tp_fsdp_gpt_ckpt")
    args = parser.parse_args()

    torch.set_num_threads(1)  # four processes share the CPU cores
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2, async_save=True)
    fabric = phalanx.Fabric(accelerator="cpu", devices=4, strategy=strategy)
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
    n_params = sum(p.numel() for p in model.parameters())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    mesh = strategy.device_mesh
    fabric.print(f"{n_params / 1e6:.2f} M parameters on a {mesh.shape[0]} x {mesh.shape[1]} mesh "
                 f"(data_parallel x tensor_parallel), {len(chars)} characters, {len(train):,} training tokens")

    # Tensor-parallel peers draw the same batches, the two replicas different ones.
    dp_rank = strategy.distributed_sampler_kwargs()["rank"]  # type: ignore[index]
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    start = time.time()
    for step in range(1, args.steps + 1):
        x, y = batch(train, gen)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad()
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        if step % 20 == 0 or step == 1:
            mean_loss = fabric.all_reduce(loss.detach())
            tokens = step * args.batch_size * args.context * mesh.shape[0]
            fabric.print(f"step {step:4d}  train loss {mean_loss.item():.3f}  "
                         f"({tokens / (time.time() - start):,.0f} tokens/s)")
        if step == args.steps // 2:
            # Returns once the shards are staged in memory; the write overlaps the next steps.
            fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": step})

    model.eval()
    val_gen = torch.Generator().manual_seed(7 + dp_rank)
    with torch.no_grad():
        losses = []
        for _ in range(8):
            x, y = batch(val, val_gen)
            logits = model(x)
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        val_loss = fabric.all_reduce(torch.stack(losses).mean()).item()
        sample_gen = torch.Generator().manual_seed(0)  # every rank samples the same characters
        idx = torch.tensor([[chars.index("T")]])
        for _ in range(120):
            probs = F.softmax(model(idx[:, -args.context :])[0, -1] / 0.8, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=sample_gen)[None]], dim=1)
    fabric.print(f"validation loss {val_loss:.3f} (perplexity {math.exp(val_loss):.1f}); sample:")
    fabric.print("".join(chars[i] for i in idx[0].tolist()))

    handle = fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": args.steps})
    handle.wait()  # this rank's part; fabric.teardown() (or the next save/load) waits for all ranks
    fabric.teardown()
    fabric.print(f"saved {args.checkpoint}/ (sharded, loads on any mesh shape); one file: "
                 f"phalanx consolidate {args.checkpoint} gpt.pt")


if __name__ == "__main__":
    main()
