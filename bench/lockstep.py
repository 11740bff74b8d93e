"""What the lockstep guard costs: DDP step time with phalanx (guard in its default mode) vs raw torch DDP.

    python bench/lockstep.py                 # 2 ranks, gloo, CPU; prints a table and the ratio
    python bench/lockstep.py --steps 500 --rounds 5 --hidden 512

Both sides run the same loop on the same small MLP: forward, backward (DDP's gradient all-reduce),
optimizer step. phalanx's backward is an *unguarded* op (a sequence number in Python, no store
traffic), so its cost is the Fabric wrappers plus the heartbeat thread. A second loop adds what
training scripts often do each step, an all-reduce of the loss for logging: that one *is* guarded
(a rendezvous on the TCPStore before the real collective), so it shows the price of a guarded op.

Each round starts fresh processes for each mode and alternates them (A B A B ...) so that drift in
machine load hits both; the table reports the median over rounds of the per-step mean.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

MODES = ("raw", "phalanx")
LOOPS = ("step", "step+log")


def build(hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def worker(mode: str, steps: int, warmup: int, hidden: int, batch: int) -> dict[str, float]:
    """Runs in each rank: returns seconds per step for each loop (rank 0's numbers are reported)."""
    model, opt = build(hidden)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    loss_fn = nn.CrossEntropyLoss()
    if mode == "phalanx":
        import phalanx

        fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()
        model, opt = fabric.setup(model, opt)

        def backward(loss: torch.Tensor) -> None:
            fabric.backward(loss)

        def log(loss: torch.Tensor) -> None:
            fabric.all_reduce(loss.detach())

        def sync() -> None:
            fabric.barrier("bench")
    else:
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        model = DistributedDataParallel(model)

        def backward(loss: torch.Tensor) -> None:
            loss.backward()

        def log(loss: torch.Tensor) -> None:
            out = loss.detach().clone()
            dist.all_reduce(out)

        def sync() -> None:
            dist.barrier()

    results = {}
    for loop in LOOPS:
        for i in range(warmup + steps):
            if i == warmup:
                sync()
                start = time.perf_counter()
            loss = loss_fn(model(x), y)
            backward(loss)
            opt.step()
            opt.zero_grad()
            if loop == "step+log":
                log(loss)
        sync()
        results[loop] = (time.perf_counter() - start) / steps
    if mode == "raw":
        dist.destroy_process_group()
    return results


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, float]:
    """Start 2 ranks by hand (env:// rendezvous) so both modes are launched identically."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--hidden", str(args.hidden), "--batch", str(args.batch)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"{mode} workers failed: exit codes {[p.returncode for p in procs]}")
    return dict(json.loads(outputs[0].strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args.worker, args.steps, args.warmup, args.hidden, args.batch)
        if int(os.environ["RANK"]) == 0:
            print(json.dumps(result), flush=True)
        return

    samples: dict[tuple[str, str], list[float]] = {(m, loop): [] for m in MODES for loop in LOOPS}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            for loop, seconds in run_mode(mode, args).items():
                samples[(mode, loop)].append(seconds)
    params = sum(p.numel() for p in build(args.hidden)[0].parameters())
    print(f"2 ranks, gloo, CPU ({os.cpu_count()} cores), MLP with {params} parameters, batch {args.batch}, "
          f"{args.steps} steps x {args.rounds} rounds, torch {torch.__version__}")
    print(f"{'loop':<10} {'raw DDP ms/step':>16} {'phalanx ms/step':>16} {'ratio':>8} {'overhead':>9}")
    for loop in LOOPS:
        raw = statistics.median(samples[("raw", loop)]) * 1e3
        ours = statistics.median(samples[("phalanx", loop)]) * 1e3
        print(f"{loop:<10} {raw:>16.3f} {ours:>16.3f} {ours / raw:>8.3f} {100 * (ours / raw - 1):>8.1f}%")
    spread = {k: f"{min(v) * 1e3:.3f}-{max(v) * 1e3:.3f}" for k, v in samples.items()}
    print("per-round range (ms/step):", ", ".join(f"{m}/{loop}: {s}" for (m, loop), s in spread.items()))


if __name__ == "__main__":
    main()
