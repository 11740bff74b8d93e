"""Seeding and RNG-state capture, so runs are repeatable and tuning phases can be undone exactly."""

from __future__ import annotations

import ctypes
import os
import random
from typing import Any

import numpy as np
import torch

_MAX_SEED = 2**32 - 1


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's, NumPy's and torch's generators (all devices) and return the seed used.

    With ``seed=None`` the seed is ``PHALANX_SEED`` when the environment sets it, else 0 (Lightning
    reads ``PL_GLOBAL_SEED`` the same way). Unlike Lightning, the seed is not written back to the
    environment: the samplers phalanx builds read torch's seed on rank 0 (``torch.initial_seed()``)
    and broadcast it, so every rank shards the same permutation however each rank was seeded
    (see :func:`phalanx.fabric.data.shared_seed`).

    ``workers`` is accepted for Lightning compatibility and changes nothing: torch already gives each
    dataloader worker its own reproducible seed for ``random``, NumPy and torch (the loader's base
    seed plus the worker id). That base seed comes from the main process's torch generator, so after
    ``seed_everything(s)`` on every rank, worker ``i`` of each rank draws the same numbers: seed
    ``s + rank`` if random augmentations must differ across ranks.
    """
    if seed is None:
        seed = int(os.environ.get("PHALANX_SEED", "0"))
    if not 0 <= int(seed) <= _MAX_SEED:
        raise ValueError(f"seed must be in [0, {_MAX_SEED}], got {seed}")
    seed = int(seed)
    random.seed(seed)
    np.random.seed(seed % _MAX_SEED)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if verbose:
        from phalanx.utils import diagnostics

        diagnostics.once_per_run(f"Seed set to {seed}", rank=int(os.environ.get("RANK", "0")))
    return seed


def capture_rng_state() -> dict[str, Any]:
    """Snapshot every generator this process uses; :func:`restore_rng_state` puts it back exactly.

    Only tensors and plain Python values, so a checkpoint holding it opens with
    ``torch.load(weights_only=True)``. The Mersenne Twister states (625 and 624 words) are int64 tensors:
    as lists, their ~1250 ints were most of the objects a checkpoint pickles (and checks) at every save."""
    return RngCapture()()


def _numpy_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _numpy_words() -> bytes | None:
    """The raw Mersenne Twister state (key and position) of NumPy's global generator, read in place; None
    where NumPy does not expose it."""
    try:
        return ctypes.string_at(np.random.mtrand._rand._bit_generator.ctypes.state_address, 624 * 4 + 4)
    except (AttributeError, TypeError, ValueError):
        return None


class RngCapture:
    """:func:`capture_rng_state` for every step (snapshots). NumPy's ``get_state()`` is most of the cost and
    the global NumPy generator is seldom used during training, so its state is read again only when its
    raw words changed, or when it held a cached Gaussian (which a call can consume without touching the
    words); otherwise the previous capture is the state, exactly. Python's words are converted again only
    when they differ from the previous capture's. The tensors returned are shared between captures: read
    them, do not change them."""

    def __init__(self) -> None:
        self._words: bytes | None = None
        self._numpy: dict[str, Any] | None = None
        self._python: tuple[Any, ...] = ()
        self._python_words = torch.empty(0)

    def __call__(self) -> dict[str, Any]:
        words = _numpy_words()
        if words is None or words != self._words or self._numpy is None or self._numpy["has_gauss"]:
            self._numpy, self._words = _numpy_state(), words
        python = random.getstate()
        if python != self._python:  # comparing 625 ints costs a fifth of converting them
            self._python, self._python_words = python, torch.from_numpy(np.array(python[1], dtype=np.int64))
        state: dict[str, Any] = {
            "python": (python[0], self._python_words, python[2]),
            "numpy": self._numpy,
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state


def restore_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1].tolist()), py[2]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
