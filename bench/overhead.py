"""Per-step framework overhead on one CPU process: the same MLP, data, seed and optimizer under a raw
PyTorch loop, phalanx Fabric, phalanx Trainer (plain, and calling ``self.log`` every step), Lightning
Fabric, Lightning Trainer and Accelerate.

    bash bench/setup.sh
    bench/.venv/bin/python bench/overhead.py [--reps 7 --steps 200 --threads 1]
    bench/.venv/bin/python bench/overhead.py --marginal --config tiny [--short 2000 --long 8000]

``--instructions`` counts instead of timing (needs ``valgrind``): each contender runs in a child process
under ``valgrind --tool=cachegrind --cache-sim=no``, once for ``--short`` and once for ``--long`` steps, and
the difference of the instruction counts divided by the difference of the steps is what one more step
executes. Children run with address-space randomisation off (``setarch -R``, where util-linux has it) and
a fixed hash seed: with random addresses, ``id()``-keyed dicts and sets probe differently each run and the
count wandered by ~8 k instructions per step; without, it repeats to a few instructions. Unlike time on a
shared machine (±10 us per step between runs of the same code on the 2-CPU development box), a framework
cost of 0.1 % is then seen directly. Instructions are not time (Python's interpreter runs fewer per
cycle than torch's kernels do), so the table gives both views.

``--marginal`` measures what one more step costs with start-up cancelled: the process CPU time of a
whole run of ``--long`` steps minus that of ``--short`` steps, divided by the difference (each
contender's setup, first-step allocations and teardown drop out). It needs only torch and phalanx;
Lightning and Accelerate join when importable.

Contenders run interleaved (raw, phalanx, ..., then the reverse order, ...) so a change in machine load hits
all of them alike; the table shows medians over repetitions and the paired ratio to raw PyTorch.
Each contender's final weights are scored on the whole dataset: the losses must agree. The headline is
process CPU time per step (what the framework costs, unaffected by waiting for a core on a busy
machine); wall time per step (median step) is shown next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    ClockedMLP,
    framework_versions,
    full_loss,
    machine_line,
    make_dataset,
    make_loader,
    make_model,
    make_optimizer,
    median,
    median_step_seconds,
    paired_ratio,
    phalanx_trainer_available,
    require_bench_venv,
    step_seconds,
    table,
)

CONFIG = {"d_in": 128, "hidden": 384, "depth": 3, "classes": 10}
CONFIGS = {"default": dict(CONFIG), "tiny": {"d_in": 16, "hidden": 32, "depth": 1, "classes": 10}}
Contender = Callable[[TensorDataset, int], ClockedMLP]


def raw_torch(data: TensorDataset, batch: int) -> ClockedMLP:
    model = make_model(CONFIG)
    opt = make_optimizer(model)
    for x, y in make_loader(data, batch):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return model


def phalanx_fabric(data: TensorDataset, batch: int) -> ClockedMLP:
    import phalanx

    fabric = phalanx.Fabric(accelerator="cpu", devices=1)
    model = make_model(CONFIG)
    wrapped, opt = fabric.setup(model, make_optimizer(model))
    for x, y in fabric.setup_dataloaders(make_loader(data, batch)):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        fabric.backward(loss)
        opt.step()
    fabric.teardown()
    return model


def lightning_fabric(data: TensorDataset, batch: int) -> ClockedMLP:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model(CONFIG)
    wrapped, opt = fabric.setup(model, make_optimizer(model))
    for x, y in fabric.setup_dataloaders(make_loader(data, batch)):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        fabric.backward(loss)
        opt.step()
    return model


def accelerate_loop(data: TensorDataset, batch: int) -> ClockedMLP:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model(CONFIG)
    wrapped, opt, loader = accelerator.prepare(model, make_optimizer(model), make_loader(data, batch))
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        accelerator.backward(loss)
        opt.step()
    accelerator.free_memory()
    return model


def lightning_trainer(data: TensorDataset, batch: int) -> ClockedMLP:
    import lightning as L

    class LitMLP(L.LightningModule):
        def __init__(self, model: ClockedMLP) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.model)

    model = make_model(CONFIG)
    # Everything a Trainer does by default that a hand-written loop does not (progress bar, logger,
    # checkpoint, summary) is switched off: this measures the step machinery, not the extras.
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(LitMLP(model), train_dataloaders=make_loader(data, batch))
    return model


def phalanx_trainer(data: TensorDataset, batch: int, log: bool = False) -> ClockedMLP:
    import phalanx

    class Module(phalanx.Module):
        def __init__(self, model: ClockedMLP) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.model(x), y)
            if log:  # the usual Lightning-style step: one metric per step
                self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.model)

    model = make_model(CONFIG)
    # Same extras off as for Lightning's Trainer: progress bar, logger, checkpointing.
    trainer = phalanx.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Module(model), train_dataloaders=make_loader(data, batch))
    return model


def phalanx_trainer_logging(data: TensorDataset, batch: int) -> ClockedMLP:
    return phalanx_trainer(data, batch, log=True)


def quiet_frameworks() -> None:
    """Keep the report readable: Lightning logs its device summary and warns about num_workers=0.
    Its loggers are configured when it is imported, so import it first, then turn them down."""
    try:
        import lightning  # noqa: F401
    except ImportError:  # --marginal runs without the peers
        pass
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for pattern in (r".*does not have many workers.*", r".*LeafSpec.*"):
        warnings.filterwarnings("ignore", message=pattern)


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def marginal(args: argparse.Namespace, config: dict[str, int]) -> None:
    """Marginal CPU time per step: (t(long) - t(short)) / (long - short), interleaved and paired."""
    import time

    contenders = _marginal_contenders()
    short, long = make_dataset(config, args.short * args.batch), make_dataset(config, args.long * args.batch)
    per_step: dict[str, list[float]] = {name: [] for name in contenders}
    losses: dict[str, float] = {}
    for fn in contenders.values():  # untimed: first-call costs (imports, lazy init) out of every timing
        fn(make_dataset(config, 50 * args.batch), args.batch)
    for rep in range(args.reps):
        order = list(contenders.items()) if rep % 2 == 0 else list(reversed(contenders.items()))
        for name, fn in order:
            seconds = {}
            for label, data in (("short", short), ("long", long)):
                start = time.process_time()
                model = fn(data, args.batch)
                seconds[label] = time.process_time() - start
                if label == "long":
                    losses[name] = full_loss(model, data)
            per_step[name].append((seconds["long"] - seconds["short"]) / (args.long - args.short))
        print(f"  rep {rep + 1}/{args.reps}: " + ", ".join(f"{n} {v[-1] * 1e6:.1f}" for n, v in per_step.items())
              + " us/step", file=sys.stderr, flush=True)
    raw = per_step["raw PyTorch"]
    rows = []
    for name, values in per_step.items():
        rows.append([
            name, f"{median(values) * 1e6:.1f}", f"{median([a - b for a, b in zip(values, raw)]) * 1e6:+.1f}",
            f"{paired_ratio(values, raw):.4f}", f"{min(values) * 1e6:.1f}",
            f"{losses[name]:.10f} (diff {abs(losses[name] - losses['raw PyTorch']):.1e})",
        ])
    n_params = sum(p.numel() for p in make_model(config).parameters())
    print(f"## Marginal CPU time per step, 1 CPU process ({machine_line()})")
    print(f"MLP {config} ({n_params} params), batch {args.batch}, AdamW, {args.threads} thread(s); "
          f"(t({args.long} steps) - t({args.short} steps)) / {args.long - args.short}, process CPU time, "
          f"{args.reps} interleaved repetitions (medians; ratio = median of paired ratios).")
    print(f"versions: {framework_versions()}")
    print(table(["contender", "us/step", "us/step over raw", "x raw", "min us/step", "final loss (long run)"],
                rows))
    if args.json:
        args.json.write_text(json.dumps({"marginal_s_per_step": per_step, "losses": losses}, indent=1))


def _child(name: str, steps: int, batch: int) -> None:
    """One contender, one run (the process that ``--instructions`` puts under valgrind)."""
    fn = _marginal_contenders()[name]
    fn(make_dataset(CONFIG, steps * batch), batch)


def _marginal_contenders() -> dict[str, Contender]:
    contenders: dict[str, Contender] = {
        "raw PyTorch": raw_torch,
        "phalanx Fabric": phalanx_fabric,
        "phalanx Trainer": phalanx_trainer,
        "phalanx Trainer + self.log": phalanx_trainer_logging,
    }
    if _importable("lightning"):
        contenders.update({"Lightning Fabric": lightning_fabric, "Lightning Trainer": lightning_trainer})
    if _importable("accelerate"):
        contenders["Accelerate"] = accelerate_loop
    return contenders


def instructions(args: argparse.Namespace) -> None:
    """Instructions per step: (Ir(long) - Ir(short)) / (long - short) under cachegrind, two children at a time."""
    import re
    import shutil
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    if shutil.which("valgrind") is None:
        sys.exit("--instructions needs valgrind (e.g. `apt-get install valgrind`).")
    names = list(_marginal_contenders())
    fixed_addresses = ["setarch", os.uname().machine, "-R"] if shutil.which("setarch") else []
    if not fixed_addresses:
        print("(setarch not found: addresses are randomised, counts vary by several k per step between runs)")

    def count(name: str, steps: int) -> int:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [*fixed_addresses, "valgrind", "--tool=cachegrind", "--cache-sim=no",
                   f"--cachegrind-out-file={tmp}/out", sys.executable, __file__, "--child", name, "--steps",
                   str(steps), "--batch", str(args.batch), "--config", args.config, "--threads", str(args.threads)]
            # A fixed hash seed: start-up work (imports, dict layouts) then repeats exactly, so it cancels.
            # One BLAS thread: an idle OpenBLAS pool thread spins, and valgrind would count its spinning.
            env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
        if done.returncode != 0 or found is None:
            raise RuntimeError(f"{name} ({steps} steps) failed under valgrind:\n{done.stderr[-3000:]}")
        return int(found.group(1).replace(",", ""))

    jobs = [(name, steps) for name in names for steps in (args.short, args.long)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: count(*job), jobs)))
    per_step = {n: (counts[(n, args.long)] - counts[(n, args.short)]) / (args.long - args.short) for n in names}
    raw = per_step["raw PyTorch"]
    rows = [[n, f"{v / 1e3:.1f}", f"{(v - raw) / 1e3:+.1f}", f"{v / raw:.4f}"] for n, v in per_step.items()]
    print(f"## Instructions per step, 1 CPU process ({machine_line()})")
    print(f"MLP {CONFIG}, batch {args.batch}, AdamW, {args.threads} thread(s); (Ir({args.long} steps) - "
          f"Ir({args.short} steps)) / {args.long - args.short}, valgrind cachegrind"
          f"{', fixed addresses' if fixed_addresses else ''}.")
    print(f"versions: {framework_versions()}")
    print(table(["contender", "k instr/step", "k instr/step over raw", "x raw"], rows))
    if args.json:
        args.json.write_text(json.dumps({"instructions_per_step": per_step}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="repetitions of the whole interleaved round")
    parser.add_argument("--steps", type=int, default=200, help="training steps per contender per repetition")
    parser.add_argument("--warmup", type=int, default=20, help="leading steps left out of the timing")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--marginal", action="store_true", help="marginal cost per step (see the docstring)")
    parser.add_argument("--short", type=int, help="--marginal/--instructions: steps of the short run (2000/200)")
    parser.add_argument("--long", type=int, help="--marginal/--instructions: steps of the long run (8000/1200)")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="default",
                        help="model size: 'tiny' (a ~0.5 ms step) makes per-step framework cost visible")
    parser.add_argument("--instructions", action="store_true",
                        help="instructions per step under valgrind (see the docstring); --short/--long default 200/600")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = CONFIGS[args.config]
    CONFIG.update(config)  # the contenders build CONFIG's model
    if args.child:
        quiet_frameworks()
        torch.set_num_threads(args.threads)
        with contextlib.redirect_stdout(sys.stderr):
            _child(args.child, args.steps, args.batch)
        return
    if args.instructions:
        require_bench_venv(["phalanx"])
        args.short, args.long = args.short or 200, args.long or 1200  # valgrind runs ~50x slower
        instructions(args)
        return
    if args.marginal:
        args.short, args.long = args.short or 2000, args.long or 8000
        require_bench_venv(["phalanx"])
        quiet_frameworks()
        torch.set_num_threads(args.threads)
        marginal(args, config)
        return
    require_bench_venv(["lightning", "accelerate", "phalanx"])
    quiet_frameworks()
    torch.set_num_threads(args.threads)

    contenders: dict[str, Contender | None] = {
        "raw PyTorch": raw_torch,
        "phalanx Fabric": phalanx_fabric,
        "phalanx Trainer": phalanx_trainer if phalanx_trainer_available() else None,
        "phalanx Trainer + self.log": phalanx_trainer_logging if phalanx_trainer_available() else None,
        "Lightning Fabric": lightning_fabric,
        "Lightning Trainer": lightning_trainer,
        "Accelerate": accelerate_loop,
    }
    # Exactly one epoch of `steps` batches, so loops and Trainers run the same number of steps.
    data = make_dataset(CONFIG, args.steps * args.batch)
    times: dict[str, list[float]] = {name: [] for name, fn in contenders.items() if fn is not None}
    mean_times: dict[str, list[float]] = {name: [] for name in times}
    cpu_times: dict[str, list[float]] = {name: [] for name in times}
    losses: dict[str, float] = {}
    for rep in range(args.reps):
        # A B C, then C B A: no contender always runs right after the same neighbour.
        order = list(contenders.items()) if rep % 2 == 0 else list(reversed(contenders.items()))
        for name, fn in order:
            if fn is None:
                continue
            model = fn(data, args.batch)
            if len(model.stamps) != args.steps:
                raise RuntimeError(f"{name} ran {len(model.stamps)} steps, expected {args.steps}.")
            times[name].append(median_step_seconds(model.stamps, args.warmup))
            mean_times[name].append(step_seconds(model.stamps, args.warmup))
            cpu_times[name].append(step_seconds(model.cpu_stamps, args.warmup))
            loss = full_loss(model, data)
            if name in losses and loss != losses[name]:
                raise RuntimeError(f"{name} is not deterministic: loss {loss!r} then {losses[name]!r}.")
            losses[name] = loss
        print(f"  rep {rep + 1}/{args.reps}: " + ", ".join(f"{n} {t[-1] * 1e3:.3f}" for n, t in times.items())
              + " ms/step", file=sys.stderr, flush=True)

    raw, raw_cpu = times["raw PyTorch"], cpu_times["raw PyTorch"]
    ref_loss = losses["raw PyTorch"]
    rows = []
    for name in contenders:
        if name not in times:
            rows.append([name, *["n/a"] * 5, "n/a (phalanx.Trainer is not importable in this checkout)"])
            continue
        cpu = cpu_times[name]
        delta_us = median([a - b for a, b in zip(cpu, raw_cpu)]) * 1e6
        rows.append([
            name, f"{median(cpu) * 1e3:.3f}", f"{delta_us:+.0f}", f"{paired_ratio(cpu, raw_cpu):.4f}",
            f"{median(times[name]) * 1e3:.3f}", f"{paired_ratio(times[name], raw):.4f}",
            f"{losses[name]:.10f} (diff {abs(losses[name] - ref_loss):.1e})",
        ])
    n_params = sum(p.numel() for p in make_model(CONFIG).parameters())
    print(f"## Per-step overhead, 1 CPU process ({machine_line()})")
    print(f"MLP {CONFIG} ({n_params / 1e6:.2f} M params), batch {args.batch}, AdamW, {args.threads} thread(s); "
          f"{args.steps} steps ({args.warmup} warm-up) x {args.reps} interleaved repetitions.")
    print(f"versions: {framework_versions()}")
    print(table(
        ["contender", "CPU ms/step", "CPU us/step over raw", "x raw (CPU)", "wall ms/step", "x raw (wall)",
         "final loss"], rows
    ))
    if args.json:
        results = {"median_step_s": times, "mean_step_s": mean_times, "cpu_step_s": cpu_times, "losses": losses}
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
