"""What the CPU benchmarks share: the model, the data, the step clock, the report table.

Every contender trains the *same* model class on the *same* tensors from the *same* seed, so the
only thing that differs between them is the framework code around the step.
"""

from __future__ import annotations

import datetime
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
BENCH_PYTHON = BENCH_DIR / ".venv" / "bin" / "python"


class ClockedMLP(nn.Module):
    """An MLP that stamps the wall clock at every forward call.

    The interval between two forwards is one whole training step (data, forward, backward,
    optimizer, and whatever the framework does in between), measured the same way for a raw loop,
    a Fabric loop and a Trainer, without needing any framework hook.
    """

    def __init__(self, d_in: int, hidden: int, depth: int, n_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = d_in
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, n_classes))
        self.net = nn.Sequential(*layers)
        self.stamps: list[float] = []
        # CPU time of the whole process (all its threads) at the same moments: on a shared machine
        # it does not grow while the process waits for a core, so it shows framework cost even
        # when wall time is noisy.
        self.cpu_stamps: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())
        out: torch.Tensor = self.net(x)
        return out


def make_model(cfg: dict[str, int], seed: int = 1234) -> ClockedMLP:
    torch.manual_seed(seed)
    return ClockedMLP(cfg["d_in"], cfg["hidden"], cfg["depth"], cfg["classes"])


def make_dataset(cfg: dict[str, int], n_samples: int, seed: int = 99) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, cfg["d_in"], generator=g)
    y = torch.randint(0, cfg["classes"], (n_samples,), generator=g)
    return TensorDataset(x, y)


def make_loader(dataset: TensorDataset, batch_size: int) -> DataLoader[Any]:
    # No shuffling: every contender must see the batches in the same order for the losses to agree.
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=True)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # foreach=False: the same per-parameter kernels for every contender, whatever each one wraps.
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def step_seconds(stamps: Sequence[float], warmup: int) -> float:
    """Mean seconds per step over the steps after ``warmup`` (forward-to-forward intervals)."""
    if len(stamps) < warmup + 2:
        raise RuntimeError(
            f"Only {len(stamps)} forward calls were recorded, need at least {warmup + 2}: the contender ran "
            "fewer steps than asked (check max_steps and the dataset length)."
        )
    return (stamps[-1] - stamps[warmup]) / (len(stamps) - 1 - warmup)


def median_step_seconds(stamps: Sequence[float], warmup: int) -> float:
    """Median forward-to-forward interval after ``warmup``: on a shared machine, robust to the
    steps during which this process was descheduled (but blind to work done only every k steps,
    which ``step_seconds`` includes)."""
    step_seconds(stamps, warmup)  # same length check
    after = stamps[warmup:]
    return float(statistics.median(b - a for a, b in itertools.pairwise(after)))


@torch.no_grad()
def full_loss(model: ClockedMLP, dataset: TensorDataset) -> float:
    """Loss of the trained weights on the whole dataset: equal weights give equal numbers."""
    x, y = dataset.tensors
    model = model.cpu().float()
    logits = model.net(x)  # not model(x): that would add a stamp
    return float(nn.functional.cross_entropy(logits.double(), y))


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def paired_ratio(values: Sequence[float], reference: Sequence[float]) -> float:
    """Median over repetitions of value/reference, each pair measured back to back (interleaved):
    drift in machine load cancels within a pair."""
    return median([v / r for v, r in zip(values, reference)])


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (readable in a terminal and pasteable into README.md)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    # The leading blank line lets Markdown render the table right after a line of prose.
    return "\n".join(["", line(headers), sep, *(line(r) for r in rows)])


def cpu_model() -> str:
    try:
        for raw in Path("/proc/cpuinfo").read_text().splitlines():
            if raw.startswith("model name"):
                return raw.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_line() -> str:
    return (
        f"{datetime.date.today().isoformat()} | {os.cpu_count()} CPUs ({cpu_model()}) | "
        f"torch {torch.__version__} | Python {platform.python_version()}"
    )


def framework_versions() -> dict[str, str]:
    """Versions of the contenders installed in this interpreter (absent ones are omitted)."""
    from importlib import metadata

    out = {}
    for name in ("torch", "phalanx", "lightning", "accelerate"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def require_bench_venv(needed: Sequence[str]) -> None:
    """Stop with the fix when a contender's package is missing (the benchmark must compare all)."""
    missing = []
    for name in needed:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        sys.exit(
            f"{', '.join(missing)} not importable in {sys.executable}. Create the benchmark environment with "
            f"`bash bench/setup.sh` and run this script with {BENCH_PYTHON.relative_to(REPO)}."
        )


def phalanx_trainer_available() -> bool:
    """Whether ``phalanx.Trainer`` exists in this checkout (it is optional for these benchmarks)."""
    try:
        import phalanx

        phalanx.Trainer  # noqa: B018 - the attribute access itself is the check (lazy import)
    except (ImportError, AttributeError):
        return False
    return True


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=REPO, capture_output=True, text=True)
        return rev + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
