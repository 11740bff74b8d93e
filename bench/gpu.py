"""GPU throughput: a GPT-2-small-sized model (124 M parameters), bf16 autocast, one GPU; a raw PyTorch
loop next to phalanx Fabric, then raw FSDP2 (``fully_shard``, bf16 parameters / float32 reduce) next
to phalanx's ``strategy="fsdp"`` (a one-process group on this GPU: the cost of the FSDP machinery
itself). Reports tokens/s and MFU.

    python bench/gpu.py [--reps 3 --steps 30 --batch 8]

Where no CUDA device exists it prints a skip line and exits 0.
"""

from __future__ import annotations

import argparse
import math
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import framework_versions, machine_line, table

# Dense bf16 tensor-core peak (no sparsity), FLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return out


class GPT(nn.Module):
    """GPT-2 small: 12 layers, 12 heads, width 768, 1024 positions, tied input/output embedding."""

    def __init__(self, vocab: int = 50304, d: int = 768, layers: int = 12, heads: int = 12, ctx: int = 1024):
        super().__init__()
        self.layers, self.d, self.ctx = layers, d, ctx
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)  # GPT-2's init: a start loss near ln(vocab), not ~40

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits

    def flops_per_token(self, seq: int) -> float:
        """6 FLOPs per weight per token (forward + backward matmuls; the tied embedding counts once,
        as the output projection) plus attention scores and values (PaLM paper, appendix B)."""
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return 6.0 * n + 12.0 * self.layers * self.d * seq


def make_batches(args: argparse.Namespace, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for _ in range(8):  # a small pool, cycled: the data pipeline is not what this measures
        tokens = torch.randint(0, 50257, (args.batch, args.seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return out


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT()


def timed_loop(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
) -> tuple[float, float]:
    """Seconds per step after the warm-up (GPU synchronized at both ends) and the last loss."""
    loss = torch.zeros(())
    for i in range(args.warmup):
        loss = step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / args.steps, float(loss)


def raw_single(args: argparse.Namespace, batches: list[Any]) -> tuple[float, float]:
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return timed_loop(step, batches, args)


def phalanx_run(strategy: str, args: argparse.Namespace, batches: list[Any]) -> tuple[float, float]:
    import phalanx

    fabric = phalanx.Fabric(accelerator="cuda", devices=1, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    model = make_model()
    # fused AdamW needs the parameters on the GPU, so the optimizer is made after setup_module.
    wrapped = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(wrapped.parameters(), lr=3e-4, fused=True))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = wrapped(x)  # phalanx's bf16-mixed precision runs the forward under autocast
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    try:
        return timed_loop(step, batches, args)
    finally:
        fabric.teardown()


def raw_fsdp(args: argparse.Namespace, batches: list[Any]) -> tuple[float, float]:
    """FSDP2's own bf16 recipe (the one phalanx's strategy="fsdp" uses for bf16-mixed): parameters
    all-gathered in bf16, gradients reduced in float32, float32 shards updated; no autocast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = make_model().cuda()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return timed_loop(step, batches, args)
    finally:
        dist.destroy_process_group()


def phalanx_has_fsdp() -> bool:
    from phalanx.strategies import available_strategies

    return "fsdp" in available_strategies()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for MFU on unlisted GPUs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("## GPU throughput: SKIPPED (no CUDA device on this machine; run bench/gpu.py where one exists).")
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next((v for k, v in PEAK_BF16.items() if k in name), None)
    batches = make_batches(args, device)

    contenders: dict[str, Callable[[argparse.Namespace, list[Any]], tuple[float, float]] | None] = {
        "raw PyTorch, 1 GPU": raw_single,
        "phalanx Fabric, 1 GPU": lambda a, b: phalanx_run("single", a, b),
        "raw FSDP2 (fully_shard), 1 GPU": raw_fsdp,
        "phalanx Fabric strategy='fsdp', 1 GPU": (
            (lambda a, b: phalanx_run("fsdp", a, b)) if phalanx_has_fsdp() else None
        ),
    }
    times: dict[str, list[float]] = {k: [] for k, fn in contenders.items() if fn is not None}
    losses: dict[str, float] = {}
    for rep in range(args.reps):
        for label, fn in contenders.items():
            if fn is None:
                continue
            seconds, losses[label] = fn(args, batches)
            times[label].append(seconds)
            torch.cuda.empty_cache()
        print(f"  rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f}" for k, v in times.items())
              + " ms/step", file=sys.stderr, flush=True)

    flops_token = make_model().flops_per_token(args.seq)
    tokens = args.batch * args.seq
    rows = []
    for label in contenders:
        if label not in times:
            rows.append([label, "n/a", "n/a", "n/a", "n/a", "n/a (phalanx has no 'fsdp' strategy registered)"])
            continue
        sec = statistics.median(times[label])
        base = times["raw PyTorch, 1 GPU"] if "FSDP" not in label and "fsdp" not in label else times[
            "raw FSDP2 (fully_shard), 1 GPU"]
        ratio = statistics.median(b / t for t, b in zip(times[label], base))
        mfu = f"{100 * tokens / sec * flops_token / peak:.1f} %" if peak else "n/a (pass --peak-tflops)"
        rows.append([label, f"{sec * 1e3:.1f}", f"{tokens / sec:,.0f}", mfu, f"{ratio:.4f}", f"{losses[label]:.4f}"])
    print(f"## GPU throughput ({machine_line()})")
    print(f"{name}; GPT-2 small ({sum(p.numel() for p in make_model().parameters()) / 1e6:.0f} M params), "
          f"bf16 (autocast on 1 GPU, FSDP2 MixedPrecisionPolicy under FSDP), batch {args.batch} x {args.seq} "
          f"tokens, fused AdamW, {args.steps} steps after "
          f"{args.warmup} warm-up x {args.reps} interleaved reps; MFU against "
          f"{'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown peak'} at {flops_token / 1e9:.2f} GFLOP/token.")
    print(f"versions: {framework_versions()}")
    print(table(["contender", "ms/step", "tokens/s", "MFU", "x its raw baseline (throughput)", "last loss"], rows))
    if any(math.isnan(v) for v in losses.values()):
        raise SystemExit("A loss is NaN: the benchmark's training diverged.")


if __name__ == "__main__":
    main()
