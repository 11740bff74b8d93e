"""GPU throughput: a GPT-2-small-sized model (124 M parameters), bf16; tokens/s and MFU.

* 1 GPU: a raw PyTorch loop next to phalanx Fabric, then raw FSDP2 (``fully_shard``, bf16 parameters /
  float32 reduce) next to phalanx's ``strategy="fsdp"`` (a one-process group on this GPU: the cost
  of the FSDP machinery itself).
* TP x FSDP on every visible GPU (``--tp``: tensor-parallel size, the rest is data parallel): raw torch
  (``init_device_mesh`` + ``parallelize_module`` + ``fully_shard`` with FSDP2's bf16 policy) next to
  phalanx's ``ModelParallelStrategy`` running the same ``parallelize`` function. Each contender runs
  in freshly spawned processes (one per GPU); rank 0 reports. On one GPU the mesh is 1 x 1: the
  cost of the DTensor/FSDP machinery, not a speed-up.

    python bench/gpu.py [--reps 3 --steps 30 --batch 8 --tp 2]

Where no CUDA device exists it prints a skip line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_loop(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
) -> tuple[float, float]:
    """Seconds per step after the warm-up (GPU synchronized at both ends) and the last loss."""
    loss = torch.zeros(())
    for i in range(args.warmup):
        loss = step(*batches[i % len(batches)])
    _sync()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(*batches[i % len(batches)])
    _sync()
    return (time.perf_counter() - start) / args.steps, float(loss)


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, backward: Callable[[torch.Tensor], Any] = torch.Tensor.backward,
    autocast: bool = False,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One optimizer step on next-token cross-entropy: the step every contender times (``backward``:
    ``fabric.backward`` for phalanx; ``autocast``: bf16 autocast around the forward)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def raw_single(args: argparse.Namespace, batches: list[Any]) -> tuple[float, float]:
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    return timed_loop(train_step(model, opt, autocast=True), batches, args)


def phalanx_run(strategy: str, args: argparse.Namespace, batches: list[Any]) -> tuple[float, float]:
    import phalanx

    fabric = phalanx.Fabric(accelerator="cuda", devices=1, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    model = make_model()
    # fused AdamW needs the parameters on the GPU, so the optimizer is made after setup_module.
    wrapped = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(wrapped.parameters(), lr=3e-4, fused=True))
    # phalanx's bf16-mixed precision runs the forward under autocast itself.
    try:
        return timed_loop(train_step(wrapped, opt, fabric.backward), batches, args)
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
        return timed_loop(train_step(model, opt), batches, args)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- TP x FSDP
class TPBlock(Block):
    """The same block with separate q, k, v projections (same FLOPs as the fused one): a column-parallel
    split of a fused qkv would hand rank 0 all of q and half of k. Heads per rank come from the local
    weight's size (``-1``), so the code is the same with and without tensor parallelism."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__(d, heads)
        del self.qkv
        self.head_dim = d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return out


# --smoke-cpu: the TP x FSDP rows on 4 CPU processes (gloo) with a tiny GPT, to check the code path here.
SMOKE = {"vocab": 256, "d": 64, "layers": 2, "heads": 4, "ctx": 64}


def make_tp_model(smoke: bool = False) -> GPT:
    torch.manual_seed(0)
    cfg = SMOKE if smoke else {"vocab": 50304, "d": 768, "layers": 12, "heads": 12, "ctx": 1024}
    model = GPT(**cfg)
    model.blocks = nn.ModuleList(TPBlock(cfg["d"], cfg["heads"]) for _ in range(cfg["layers"]))
    return model


def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    """Megatron-style blocks over 'tensor_parallel'; every block and the root sharded over 'data_parallel'
    with FSDP2's bf16 recipe. The tied embedding/output layer stays data-parallel only (replicated over
    the tensor-parallel ranks, which therefore repeat its matmul; MFU counts it once)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "proj": RowwiseParallel(),
            "fc": ColwiseParallel(), "out": RowwiseParallel()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh["tensor_parallel"], plan)
        fully_shard(block, mesh=mesh["data_parallel"], mp_policy=policy)
    fully_shard(model, mesh=mesh["data_parallel"], mp_policy=policy)
    return model


def _mesh_shape(args: argparse.Namespace) -> tuple[int, int]:
    world = 4 if args.smoke_cpu else torch.cuda.device_count()
    tp = min(args.tp, world)
    if world % tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} visible GPUs.")
    return world // tp, tp


def _tp_worker(rank: int, kind: str, args: argparse.Namespace, port: int, results: Any) -> None:
    """One rank of one 2-D contender: raw torch or phalanx, same model, plan, data and optimizer."""
    dp, tp = _mesh_shape(args)
    world = dp * tp
    if args.smoke_cpu:
        torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    vocab = SMOKE["vocab"] if args.smoke_cpu else 50257
    # Tensor-parallel peers train on the same batch, data-parallel ranks on different ones.
    gen = torch.Generator().manual_seed(rank // tp)
    batches = []
    for _ in range(8):
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
        batches.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    if kind == "raw":
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
            model = parallelize(make_tp_model(args.smoke_cpu), mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
            result = timed_loop(train_step(model, opt), batches, args)
        finally:
            dist.destroy_process_group()
    else:
        import phalanx
        from phalanx.strategies import ModelParallelStrategy

        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # bf16 the FSDP2 way, exactly as the raw contender: the policy is inside parallelize.
        strategy = ModelParallelStrategy(parallelize, dp, tp)
        fabric = phalanx.Fabric(accelerator=device.type, devices=world, strategy=strategy, precision="32-true")
        fabric.launch()
        try:
            wrapped = fabric.setup_module(make_tp_model(args.smoke_cpu))
            opt = fabric.setup_optimizers(torch.optim.AdamW(wrapped.parameters(), lr=3e-4, foreach=True))
            result = timed_loop(train_step(wrapped, opt, fabric.backward), batches, args)
        finally:
            fabric.teardown()
    if rank == 0:
        results.put(result)


def run_2d(kind: str, args: argparse.Namespace, batches: list[Any]) -> tuple[float, float]:
    """Seconds per step and last loss of a TP x FSDP contender on every visible GPU (fresh processes)."""
    dp, tp = _mesh_shape(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_tp_worker, args=(kind, args, port, results), nprocs=dp * tp, join=True,
                       start_method="spawn")
    seconds, loss = results.get()
    return float(seconds), float(loss)


def phalanx_has_model_parallel() -> bool:
    from phalanx.strategies import available_strategies

    return "model_parallel" in available_strategies()


def phalanx_has_fsdp() -> bool:
    from phalanx.strategies import available_strategies

    return "fsdp" in available_strategies()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (per data-parallel rank)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the TP x FSDP rows "
                        "(capped at the visible GPUs; the rest of them is data parallel)")
    parser.add_argument("--no-2d", action="store_true", help="skip the TP x FSDP rows")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for MFU on unlisted GPUs")
    parser.add_argument("--smoke-cpu", action="store_true", help="check the TP x FSDP code path without a GPU: "
                        "both 2-D contenders, tiny GPT, 4 CPU processes (gloo), 2 x 2 mesh; prints their losses")
    args = parser.parse_args()
    if args.smoke_cpu:
        args.seq, args.batch, args.steps, args.warmup, args.tp = 32, 2, 3, 1, 2
        for kind in ("raw", "phalanx"):
            seconds, loss = run_2d(kind, args, [])
            print(f"{kind:8s} TP x FSDP 2 x 2 on CPU: {seconds * 1e3:.1f} ms/step, last loss {loss:.6f}")
        return
    if not torch.cuda.is_available():
        print("## GPU throughput: SKIPPED (no CUDA device on this machine; run bench/gpu.py where one exists).")
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next((v for k, v in PEAK_BF16.items() if k in name), None)
    batches = make_batches(args, device)
    dp, tp = _mesh_shape(args)
    mesh = f"{dp} x {tp} mesh, {dp * tp} GPU{'s' if dp * tp > 1 else ''}"
    raw_2d = f"raw TP x FSDP2 (parallelize_module + fully_shard), {mesh}"
    ours_2d = f"phalanx ModelParallelStrategy, {mesh}"

    Runner = Callable[[argparse.Namespace, list[Any]], tuple[float, float]]
    # label -> (runner, its raw baseline, GPUs used, data-parallel replicas, why a runner may be missing)
    contenders: dict[str, tuple[Runner | None, str, int, int, str]] = {
        "raw PyTorch, 1 GPU": (raw_single, "raw PyTorch, 1 GPU", 1, 1, ""),
        "phalanx Fabric, 1 GPU": (lambda a, b: phalanx_run("single", a, b), "raw PyTorch, 1 GPU", 1, 1, ""),
        "raw FSDP2 (fully_shard), 1 GPU": (raw_fsdp, "raw FSDP2 (fully_shard), 1 GPU", 1, 1, ""),
        "phalanx Fabric strategy='fsdp', 1 GPU": (
            (lambda a, b: phalanx_run("fsdp", a, b)) if phalanx_has_fsdp() else None,
            "raw FSDP2 (fully_shard), 1 GPU", 1, 1, "phalanx has no 'fsdp' strategy registered"),
    }
    if not args.no_2d:
        contenders[raw_2d] = (lambda a, b: run_2d("raw", a, b), raw_2d, dp * tp, dp, "")
        contenders[ours_2d] = (
            (lambda a, b: run_2d("phalanx", a, b)) if phalanx_has_model_parallel() else None, raw_2d, dp * tp, dp,
            "phalanx has no 'model_parallel' strategy registered")
    times: dict[str, list[float]] = {k: [] for k, (fn, *_) in contenders.items() if fn is not None}
    losses: dict[str, float] = {}
    for rep in range(args.reps):
        for label, (fn, *_) in contenders.items():
            if fn is None:
                continue
            seconds, losses[label] = fn(args, batches)
            times[label].append(seconds)
            torch.cuda.empty_cache()
        print(f"  rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f}" for k, v in times.items())
              + " ms/step", file=sys.stderr, flush=True)

    flops_token = make_model().flops_per_token(args.seq)
    rows = []
    for label, (_, baseline, gpus, replicas, missing) in contenders.items():
        if label not in times:
            rows.append([label, "n/a", "n/a", "n/a", "n/a", f"n/a ({missing})"])
            continue
        # Tokens of one optimizer step over all data-parallel replicas; MFU against the peak of all GPUs used.
        tokens = args.batch * args.seq * replicas
        sec = statistics.median(times[label])
        ratio = statistics.median(b / t for t, b in zip(times[label], times[baseline]))
        mfu = f"{100 * tokens / sec * flops_token / (peak * gpus):.1f} %" if peak else "n/a (pass --peak-tflops)"
        rows.append([label, f"{sec * 1e3:.1f}", f"{tokens / sec:,.0f}", mfu, f"{ratio:.4f}", f"{losses[label]:.4f}"])
    print(f"## GPU throughput ({machine_line()})")
    print(f"{name}; GPT-2 small ({sum(p.numel() for p in make_model().parameters()) / 1e6:.0f} M params), "
          f"bf16 (autocast on 1 GPU, FSDP2 MixedPrecisionPolicy under FSDP and TP x FSDP), batch {args.batch} x "
          f"{args.seq} tokens per data-parallel rank, AdamW (fused; foreach under TP), {args.steps} steps after "
          f"{args.warmup} warm-up x {args.reps} interleaved reps; MFU against "
          f"{'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown peak'} per GPU at {flops_token / 1e9:.2f} "
          "GFLOP/token.")
    print(f"versions: {framework_versions()}")
    print(table(["contender", "ms/step", "tokens/s", "MFU", "x its raw baseline (throughput)", "last loss"], rows))
    if any(math.isnan(v) for v in losses.values()):
        raise SystemExit("A loss is NaN: the benchmark's training diverged.")


if __name__ == "__main__":
    main()
