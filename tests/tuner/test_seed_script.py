"""Seed 002's script (bench/_lr_seed002.py), as its user ran it: the ``LearningRateFinder`` callback, then a 3-epoch
fit. Its suggestion must train within 3x of the best validation loss of a 13-point grid (1e-4 ... 1, 3 per decade)
fitted here the same way, at ``num_training_steps=30`` and at the default (100).

Issue 33's rule suggested 0.149 at 30 steps for seed 1 (the steepest point, just below the curve's lowest point,
0.28): its fit ends at 2.4, worse than chance (1.39), where the grid's best is 0.19 at 0.01. Seed 1 runs in the
default tier; seeds 0 and 2 are ``slow``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils.data import DataLoader
from trainer_support import quiet

import phalanx
from phalanx.callbacks import LearningRateFinder

BENCH = Path(__file__).resolve().parents[2] / "bench"
GRID = [10 ** (-4 + k / 3) for k in range(13)]


@pytest.fixture(scope="module")
def script() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCH))
        import _lr_seed002

        yield _lr_seed002


def run(script: ModuleType, seed: int, lr: float = 1e-3,
        finder: LearningRateFinder | None = None) -> float:
    """The script at ``lr`` (or at what ``finder`` suggests): its validation loss after 3 epochs (inf when the fit
    diverged)."""
    phalanx.seed_everything(seed, verbose=False)
    train, val = script.seed002_data(seed)
    module = script.Seed002(lr)
    trainer = phalanx.Trainer(max_epochs=3, callbacks=[finder] if finder is not None else [], **quiet())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the data loader's worker hint
        try:
            trainer.fit(module, DataLoader(train, batch_size=64, shuffle=True), DataLoader(val, batch_size=256))
        except FloatingPointError:  # the grid's largest learning rates diverge
            return math.inf
    return float(trainer.callback_metrics["val_loss"])


@pytest.mark.parametrize("seed", [pytest.param(0, marks=pytest.mark.slow), 1, pytest.param(2, marks=pytest.mark.slow)])
def test_seed_002s_script_trains_within_3x_of_the_grids_best(script: ModuleType, seed: int) -> None:
    torch.set_num_threads(1)
    best = min(run(script, seed, lr) for lr in GRID)
    for steps in (30, 100):
        finder = LearningRateFinder(num_training_steps=steps) if steps != 100 else LearningRateFinder()
        loss = run(script, seed, finder=finder)
        result = finder.optimal_lr
        assert finder.lr is not None and result is not None
        assert loss <= 3 * best, (steps, finder.lr, loss, best)
        assert loss < math.log(4)  # better than chance
        assert finder.lr in result.probe_lrs  # the probe fits decided ...
        lowest = result.lrs[min(range(len(result.raw_losses)), key=lambda i: result.raw_losses[i])]
        assert max(result.probe_lrs) < lowest  # ... all below where the search's loss was lowest
