"""Seeding and RNG-state capture, so runs are repeatable and tuning phases can be undone exactly."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

_MAX_SEED = 2**32 - 1


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's, NumPy's and torch's generators (all devices) and return the seed used.

    With ``seed=None`` the seed comes from ``PHALANX_SEED`` or is 0, so every rank of a job agrees.
    ``workers=True`` additionally makes dataloader workers derive distinct, reproducible seeds
    (see :func:`phalanx.data.worker_init_fn`).
    """
    if seed is None:
        seed = int(os.environ.get("PHALANX_SEED", "0"))
    if not 0 <= int(seed) <= _MAX_SEED:
        raise ValueError(f"seed must be in [0, {_MAX_SEED}], got {seed}")
    seed = int(seed)
    # Child processes (launched ranks, dataloader workers) read these back.
    os.environ["PHALANX_SEED"] = str(seed)
    os.environ["PHALANX_SEED_WORKERS"] = "1" if workers else "0"
    random.seed(seed)
    np.random.seed(seed % _MAX_SEED)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if verbose:
        from phalanx import diagnostics

        diagnostics.info(f"Seed set to {seed}", rank=int(os.environ.get("RANK", "0")))
    return seed


def capture_rng_state() -> dict[str, Any]:
    """Snapshot every generator this process uses; :func:`restore_rng_state` puts it back exactly."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
