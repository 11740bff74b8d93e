"""Checkpoint save/load time under FSDP: phalanx vs raw torch, same model, same run, 2 CPU ranks.

    python bench/checkpoint.py [--params 50e6] [--reps 3] [--quick] [--out table.md]

Model: a stack of square Linear layers (~``--params`` parameters) + AdamW after one step, so the
optimizer holds two more copies: ~4x the parameter bytes in all. Contenders, interleaved per repetition:

* sharded save: ``fabric.save`` (state_dict_type="sharded": guarded, temp dir, fsync, atomic rename) vs
  raw ``torch.distributed.checkpoint.save`` of ``get_model/optimizer_state_dict`` into a directory.
* sharded load: ``fabric.load`` vs raw ``dcp.load`` into the same templates + ``set_*_state_dict``.
* full save: ``fabric.save`` (state_dict_type="full": gather to rank 0, one fsynced file, atomic rename)
  vs raw full ``get_*_state_dict(cpu_offload=True)`` + ``torch.save`` on rank 0.
* full save vs ``torch.save`` + ``fsync``: the same, with the raw file forced to disk as phalanx's is.
* full save vs atomic ``torch.save``: raw written as safely as phalanx writes (fresh temporary file,
  fsync, rename over the target) instead of truncating and overwriting the previous file in place.
* full load: ``fabric.load`` vs raw rank-0 ``torch.load`` + ``set_*_state_dict(broadcast_from_rank0=True)``.

Each timing starts and ends with a barrier, measured on rank 0; the table reports medians and the
median of the paired ratios phalanx/raw.

``--stall``: what a checkpoint costs the *training loop*. The same model trains for ``--steps`` steps,
saving a sharded checkpoint every ``--every`` steps, three ways interleaved per repetition: no save,
``fabric.save`` synchronous, and ``FSDPStrategy(async_save=True)`` (the call returns once the shards are
copied into memory; the write overlaps the next steps and competes with them for the CPU).
Reported: the step that calls ``save`` (the stall), the other steps, and the whole window including
the wait for the last write.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import phalanx
from phalanx.strategies import FSDPStrategy


def build(fabric: phalanx.Fabric, n_params: float) -> tuple[Any, Any]:
    width = 2048
    depth = max(1, round(n_params / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # the optimizer now holds exp_avg and exp_avg_sq
    return model, opt


def timed(fabric: phalanx.Fabric, fn: Callable[[], Any]) -> float:
    # Flush every dirty page first (untimed): otherwise a contender that returns without fsync leaves
    # ~600 MB of write-back that lands on whichever contender runs next.
    os.sync()
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def stall(args: argparse.Namespace) -> None:
    """Per-step wall time of a training loop that saves every ``args.every`` steps: none / sync / async."""
    strategy = FSDPStrategy()  # ModelParallelStrategy inherits the same asynchronous saves
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model, opt = build(fabric, args.params)
    width = model.module[0].in_features
    n = sum(p.numel() for p in model.module.parameters())
    root = Path(fabric.broadcast(tempfile.mkdtemp(prefix="phalanx-stall-bench-") if fabric.is_global_zero else None))
    x = torch.randn(8, width)

    def window(mode: str) -> tuple[list[float], list[float], float]:
        """(save-step seconds, other-step seconds, window seconds) on rank 0."""
        strategy.async_save = mode == "async"
        os.sync()
        dist.barrier()
        saves, others = [], []
        start = time.perf_counter()
        handle = None
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            opt.zero_grad()
            fabric.backward(model(x).pow(2).mean())
            opt.step()
            if mode != "none" and step % args.every == 0:
                handle = fabric.save(root / "ckpt", {"model": model, "optimizer": opt, "step": step})
                saves.append(time.perf_counter() - t0)
            else:
                others.append(time.perf_counter() - t0)
        if handle is not None:
            handle.wait()
        dist.barrier()  # every rank's part written (and published, on rank 0)
        return saves, others, time.perf_counter() - start

    modes = ("none", "sync", "async")
    results: dict[str, list[tuple[list[float], list[float], float]]] = {m: [] for m in modes}
    for rep in range(-args.warmup, args.reps):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            out = window(mode)
            if rep >= 0:
                results[mode].append(out)
    if fabric.is_global_zero:
        def med(values: list[float]) -> str:
            return f"{statistics.median(values):.3f}" if values else "-"

        base = statistics.median(w for _, _, w in results["none"])
        lines = [
            f"2 CPU ranks (gloo), {n / 1e6:.1f} M parameters + AdamW state, a sharded save every {args.every} of "
            f"{args.steps} steps, torch {torch.__version__}; medians over {args.reps} interleaved repetitions "
            f"after {args.warmup} untimed.",
            "",
            "| checkpointing | step that saves (s) | other steps (s) | window (s) | window / no save |",
            "| --- | --- | --- | --- | --- |",
        ]
        for mode, label in zip(modes, ("none", "fabric.save, synchronous", "fabric.save, async_save=True")):
            saves = [t for s, _, _ in results[mode] for t in s]
            others = [t for _, o, _ in results[mode] for t in o]
            win = statistics.median(w for _, _, w in results[mode])
            lines.append(f"| {label} | {med(saves)} | {med(others)} | {win:.2f} | {win / base:.2f} |")
        table = "\n".join(lines)
        print(table)
        if args.out is not None:
            args.out.write_text(table + "\n")
    fabric.barrier("bench done")
    fabric.teardown()
    if fabric.is_global_zero:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--warmup", type=int, default=1,
        help="untimed repetitions first: the first write of a ~600 MB file grows the page cache and costs "
             "2-5x a steady-state write, which would land on whichever contender runs first",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, one repetition (checks the script)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    parser.add_argument("--stall", action="store_true", help="measure the training-step stall instead: no save / "
                        "synchronous / asynchronous sharded saves every --every steps")
    parser.add_argument("--steps", type=int, default=20, help="--stall: training steps per window")
    parser.add_argument("--every", type=int, default=5, help="--stall: save every this many steps")
    args = parser.parse_args()
    if args.quick:
        args.params, args.reps, args.warmup = 5e6, 1, 0
    torch.set_num_threads(1)
    if args.stall:
        stall(args)
        return
    strategy = FSDPStrategy()
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model, opt = build(fabric, args.params)
    raw_model = model.module
    n = sum(p.numel() for p in raw_model.parameters())
    root = Path(fabric.broadcast(tempfile.mkdtemp(prefix="phalanx-ckpt-bench-") if fabric.is_global_zero else None))
    state = {"model": model, "optimizer": opt, "step": 1}
    zero = fabric.is_global_zero

    def phalanx_save(kind: str) -> Callable[[], None]:
        def run() -> None:
            strategy.state_dict_type = kind
            fabric.save(root / f"phalanx-{kind}", state)
        return run

    def phalanx_load(kind: str) -> Callable[[], None]:
        return lambda: fabric.load(root / f"phalanx-{kind}", state)

    def raw_sharded_save() -> None:
        sd = {"model": get_model_state_dict(raw_model), "optimizer": get_optimizer_state_dict(raw_model, opt)}
        dcp_save(sd, storage_writer=FileSystemWriter(str(root / "raw-sharded")))

    def raw_sharded_load() -> None:
        sd = {"model": get_model_state_dict(raw_model), "optimizer": get_optimizer_state_dict(raw_model, opt)}
        dcp_load(sd, storage_reader=FileSystemReader(str(root / "raw-sharded")))
        set_model_state_dict(raw_model, sd["model"])
        set_optimizer_state_dict(raw_model, opt, sd["optimizer"])

    def raw_full_state() -> dict[str, Any]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"model": get_model_state_dict(raw_model, options=options),
                "optimizer": get_optimizer_state_dict(raw_model, opt, options=options)}

    def write_fsynced(sd: dict[str, Any], target: Path) -> None:
        with open(target, "wb") as fh:
            torch.save(sd, fh)
            fh.flush()
            os.fsync(fh.fileno())

    def raw_full_save() -> None:
        sd = raw_full_state()
        if zero:
            torch.save(sd, root / "raw-full.pt")

    def raw_full_save_fsync() -> None:
        # The same plus fsync before returning: what phalanx's atomic write does for crash durability.
        sd = raw_full_state()
        if zero:
            write_fsynced(sd, root / "raw-full-fsync.pt")

    def raw_full_save_atomic() -> None:
        # As crash-safe as phalanx's write: a fresh temporary file, fsync, rename over the target.
        sd = raw_full_state()
        if zero:
            tmp = root / f".raw-full-atomic.pt.tmp-{time.monotonic_ns()}"
            write_fsynced(sd, tmp)
            os.replace(tmp, root / "raw-full-atomic.pt")

    def raw_full_load() -> None:
        sd = torch.load(root / "raw-full.pt", weights_only=False) if zero else {"model": {}, "optimizer": {}}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(raw_model, sd["model"], options=options)
        set_optimizer_state_dict(raw_model, opt, sd["optimizer"], options=options)

    rows = [
        ("sharded save", phalanx_save("sharded"), raw_sharded_save),
        ("sharded load", phalanx_load("sharded"), raw_sharded_load),
        ("full save", phalanx_save("full"), raw_full_save),
        ("full save vs torch.save+fsync", phalanx_save("full"), raw_full_save_fsync),
        ("full save vs atomic torch.save", phalanx_save("full"), raw_full_save_atomic),
        ("full load", phalanx_load("full"), raw_full_load),
    ]
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _, _ in rows}
    for rep in range(-args.warmup, args.reps):
        for name, ours, raw in rows:
            # Alternate which contender goes first, so page-cache warmth favours neither.
            pair = [(0, ours), (1, raw)] if rep % 2 == 0 else [(1, raw), (0, ours)]
            for slot, fn in pair:
                seconds = timed(fabric, fn)
                if rep >= 0:
                    times[name][slot].append(seconds)
    if zero:
        size = sum(f.stat().st_size for f in (root / "phalanx-sharded").iterdir()) / 2**20
        lines = [
            f"2 CPU ranks (gloo), {n / 1e6:.1f} M parameters + AdamW state, {size:.0f} MiB on disk, "
            f"torch {torch.__version__}, median of {args.reps} interleaved repetitions after {args.warmup} untimed.",
            "",
            "| operation | phalanx (s) | raw torch (s) | phalanx / raw |",
            "| --- | --- | --- | --- |",
        ]
        for name, _, _ in rows:
            ours, raw = times[name]
            ratio = statistics.median(a / b for a, b in zip(ours, raw))
            lines.append(f"| {name} | {statistics.median(ours):.3f} | {statistics.median(raw):.3f} | {ratio:.2f} |")
        table = "\n".join(lines)
        print(table)
        if args.out is not None:
            args.out.write_text(table + "\n")
    fabric.barrier("bench done")
    if zero:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
