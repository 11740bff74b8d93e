"""The learning rate ``LRFinderResult.suggestion()`` picks (phalanx.tuner.suggest), pinned on curves that
tell rules apart: a noisy one, a short one, one still falling at max_lr, one that never descends.

The curves are synthetic and seeded: a plateau, a descent whose steepest point against log(lr) is
known, then divergence; every step's loss carries multiplicative noise. phalanx's previous rule (the
steepest slope of the moving average against log(lr)) and Lightning 2.6.6's (the steepest slope
against lr) come from bench/_lr_rules.py, the benchmark's implementations, to show that each curve
is one on which they go wrong.
"""

from __future__ import annotations

import importlib
import math
import re
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
from trainer_support import Regressor, loader, quiet

import phalanx
from phalanx.callbacks import LearningRateFinder
from phalanx.tuner import LRFinderResult, Tuner
from phalanx.tuner.suggest import LONG_PROBE, suggest
from phalanx.utils.errors import PhalanxWarning

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def other_rules(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("_lr_rules")


def range_test(n: int, noise: float, seed: int, centre: float, edge: float, steepness: float = 3.0,
               descent: bool = True) -> LRFinderResult:
    """``n`` steps from lr 1e-8 to 1. The log-loss falls from log(2.3) to log(0.4) along a logistic in
    log10(lr) centred at ``centre`` (the steepest point), rises quadratically past ``edge``, and each
    step's loss is multiplied by exp(noise * N(0, 1)). ``losses`` is the moving average the search
    records (beta 0.98, bias-corrected)."""
    g = torch.Generator().manual_seed(seed)
    result = LRFinderResult(mode="exponential")
    average = 0.0
    for i in range(n):
        x = -8 + 8 * i / (n - 1)
        level = math.log(2.3) + 4 * max(0.0, x - edge) ** 2
        if descent:
            level -= math.log(2.3 / 0.4) / (1 + math.exp(-steepness * (x - centre)))
        loss = math.exp(level + noise * float(torch.randn((), generator=g)))
        average = 0.98 * average + 0.02 * loss
        result.lrs.append(10**x)
        result.raw_losses.append(loss)
        result.losses.append(average / (1 - 0.98 ** (i + 1)))
    return result


def test_a_noisy_curve_gets_the_steepest_point_of_its_descent(other_rules: ModuleType) -> None:
    result = range_test(100, noise=0.2, seed=2, centre=-2.3, edge=-1.2)  # steepest at 5e-3
    assert 2.5e-3 <= result.suggestion() <= 1e-2  # type: ignore[operator]
    # The noise on the flat start is steeper than the descent for both other rules.
    curve = other_rules.Curve(result)
    assert other_rules.phalanx_before(curve) < 1e-6
    assert other_rules.lightning(curve) < 1e-6


def test_a_short_curve_gets_the_steepest_point_of_its_descent(other_rules: ModuleType) -> None:
    result = range_test(30, noise=0.1, seed=0, centre=-1.3, edge=-0.7, steepness=5.0)  # steepest at 0.05
    assert 0.025 <= result.suggestion() <= 0.1  # type: ignore[operator]
    curve = other_rules.Curve(result)
    # The moving average lags: it falls fastest where the loss itself already turns up (0.15 here);
    # Lightning's slope against lr itself is largest on the flat start.
    assert other_rules.phalanx_before(curve) >= 0.1
    assert other_rules.lightning(curve) < 1e-3


def test_a_curve_still_falling_at_max_lr_gets_its_steepest_point_not_the_end(other_rules: ModuleType) -> None:
    """The linear regression's shape (plain SGD, bench/lr_finder.py): at max_lr the loss still falls at
    a third of its steepest rate, so the lowest point is the last one and says nothing about where the
    descent ends. On the curve alone (no probe fits ran: test_lr_find.py) the suggestion stays at the
    steepest point inside the range, and the curve is marked still falling, which is where lr_find
    runs its probe fits; a rule built on the lowest point moves with max_lr instead."""
    result = range_test(100, noise=0.1, seed=0, centre=-0.6, edge=1.0, steepness=4.0)  # steepest at 0.25
    assert 0.15 <= result.suggestion() <= 0.35  # type: ignore[operator]
    assert suggest(result.lrs, result.raw_losses, result.mode).still_falling
    # A curve that turned up is not: the noisy one above, its edge at 0.06.
    turned = range_test(100, noise=0.2, seed=2, centre=-2.3, edge=-1.2)
    assert not suggest(turned.lrs, turned.raw_losses, turned.mode).still_falling
    assert other_rules.lowest_over_2(other_rules.Curve(result)) == 0.5  # the lowest point is lr 1, the end


def test_the_guard_keeps_a_suggestion_below_half_the_lowest_point(other_rules: ModuleType) -> None:
    """Seed 002's shape on a 30-step search: the descent runs into the edge of stability, so the steepest point
    (0.079) lies within a factor 2 of the lowest (0.15), where the search's loss has stopped falling and a fit
    trains badly. On the curve alone the suggestion is capped at half the lowest point; issue 33's rule took the
    steepest point (lr_find's probe fits then decide below the cap: test_lr_find.py)."""
    result = range_test(30, noise=0.05, seed=0, centre=-1.0, edge=-0.8, steepness=5.0)
    found = suggest(result.lrs, result.raw_losses, result.mode)
    assert found.steepest is not None and found.lowest is not None and not found.still_falling
    assert found.steepest > found.lowest / 2 and found.lr == result.suggestion() == found.lowest / 2
    assert other_rules.steepest_centred(other_rules.Curve(result)) == found.steepest


def test_a_noise_free_curve_gets_its_steepest_point_and_the_plot_saves(tmp_path: Path) -> None:
    lrs = [10 ** (-6 + 6 * i / 59) for i in range(60)]
    # Flat, then falling fastest around 1e-3, then exploding: every rule agrees here.
    losses = [2.0 - math.tanh(3 * (math.log10(lr) + 3)) + (lr * 50) ** 2 for lr in lrs]
    result = LRFinderResult(lrs, losses)
    assert 5e-4 < result.suggestion() < 2e-3  # type: ignore[operator]
    result.plot().savefig(tmp_path / "lr.png")
    assert (tmp_path / "lr.png").read_bytes()[:4] == b"\x89PNG"


def test_a_spike_after_the_lowest_point_is_not_the_descent() -> None:
    lrs = [10 ** (-6 + 6 * i / 59) for i in range(60)]
    losses = [2.0 - math.tanh(3 * (math.log10(lr) + 3)) for lr in lrs]
    losses[50:55] = [8.0, 8.0, 8.0, 1.2, 1.2]  # diverges, then partly recovers: a steep fall at 0.1
    assert 5e-4 < LRFinderResult(lrs, losses).suggestion() < 2e-3  # type: ignore[operator]


NEVER_FELL = (
    "No learning rate suggested: the loss never fell clearly below where it started (it fell at most {fell}; "
    "with this much noise a fall takes {takes}). Widen the range (lower min_lr if the loss was already falling "
    "at the start, higher max_lr if it never started to fall) or run more steps (num_training; this search ran "
    "{steps}), so that each learning rate is averaged over more batches."
)


def test_a_curve_that_never_descends_gets_no_suggestion_and_says_what_to_do(tmp_path: Path) -> None:
    flat = range_test(100, noise=0.1, seed=1, centre=0.0, edge=-0.5, descent=False)
    with pytest.warns(PhalanxWarning, match=re.escape(NEVER_FELL.format(fell="3.2%", takes="17.3%", steps=100))):
        assert flat.suggestion() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per result and arguments: the plot does not repeat it
        assert flat.suggestion() is None
        flat.plot().savefig(tmp_path / "flat.png")
    rising = LRFinderResult([10.0**-k for k in range(20, 0, -1)], [1.0 + k / 10 for k in range(20)])
    with pytest.warns(PhalanxWarning, match=re.escape(NEVER_FELL.format(fell="0.0%", takes="16.2%", steps=20))):
        assert rising.suggestion() is None
    with pytest.warns(PhalanxWarning, match=re.escape(
            "No learning rate suggested: 7 finite losses remain after skip_begin=10 and skip_end=3, and the rule "
            "needs 8. Run more steps (num_training), or start lower (min_lr) if the loss blew up early.")):
        assert rising.suggestion(skip_begin=10, skip_end=3) is None


@pytest.mark.parametrize("seed", range(3))
def test_a_curve_that_never_fell_but_blew_up_is_probed_below_where_it_rose_not_where_the_search_ended(
        seed: int) -> None:
    """Flat and noisy until it blows up past 10**-1.5, and the 30-step search ran on to max_lr (its early stop
    watches a moving average that trails the blow-up): the probes' top is a quarter of where the curve first
    rose clearly, not a quarter of 1."""
    blown = range_test(30, noise=0.1, seed=seed, centre=0.0, edge=-1.5, descent=False)
    found = suggest(blown.lrs, blown.raw_losses, blown.mode)
    assert found.lr is None and found.top is not None and blown.lrs[-1] == 1.0
    assert 10**-1.5 <= 4 * found.top <= 10**-1  # the first lr 4 standard errors above the start


def test_a_short_search_says_to_run_more_steps_and_a_blown_up_one_to_start_lower() -> None:
    short = LRFinderResult([1e-8, 1.2e-8, 1.45e-8, 1.75e-8], [0.42, 1.68, 0.99, 8.14])
    with pytest.warns(PhalanxWarning, match=re.escape(
            "No learning rate suggested: the search ran 4 steps, every loss finite, and the rule needs 8. Raise "
            "num_training.")):
        assert short.suggestion() is None
    blown = LRFinderResult([1e-8, 1e-6, 1e-4, 1e-2], [0.42, 0.40, 0.39, math.inf])
    with pytest.warns(PhalanxWarning, match=r"3 finite losses remain .* start lower \(min_lr\) if the loss blew up"):
        assert blown.suggestion() is None


def test_without_a_suggestion_lr_find_and_the_callback_keep_the_learning_rate() -> None:
    """A range far below where this model learns: nothing to suggest, said once, and the fit goes on
    with the learning rate the model had."""
    model = Regressor(optimizer="sgd", lr=0.05, scheduler=False)
    trainer = phalanx.Trainer(max_epochs=1, **quiet())
    with pytest.warns(PhalanxWarning, match=r"never fell clearly") as caught:
        result = Tuner(trainer).lr_find(model, train_dataloaders=loader(64, 8), min_lr=1e-8, max_lr=1e-6,
                                        num_training=24)
    assert result.suggestion() is None and model.lr == 0.05
    # The probe fits below the range's end, and a decade lower, fell no more than the curve; nor did the highest
    # again, 4x as long (every short probe ended above where it started: none is the best).
    assert len(result.probe_lrs) == 9 and result.probe_lrs[4:8] == pytest.approx(
        [min(result.probe_lrs[:4]) * 10 ** (-k / 3) for k in range(1, 5)])
    assert result.probe_lrs[8] == max(result.probe_lrs[:8])
    assert len(result.probe_losses[8]) == LONG_PROBE * result.probe_length
    assert len([w for w in caught if issubclass(w.category, PhalanxWarning)]) == 1

    finder = LearningRateFinder(min_lr=1e-8, max_lr=1e-6, num_training_steps=24)
    trainer = phalanx.Trainer(max_epochs=1, callbacks=[finder], **quiet())
    with pytest.warns(PhalanxWarning, match=r"never fell clearly") as caught:
        trainer.fit(model, loader(64, 8))
    assert finder.lr is None and model.lr == 0.05 and trainer.optimizer.param_groups[0]["lr"] == 0.05
    assert len([w for w in caught if issubclass(w.category, PhalanxWarning)]) == 1
