"""The probe fits ``lr_find`` runs after its search (phalanx.tuner.suggest): four short fits a third of a decade
apart, from the top of the curve's bracket down, and the suggestion is the one whose loss ends lowest. Pinned on
linear regressions with plain SGD, whose edge of stability is set by the features' scale: on features of scales
0.1 to 1 the curve is still falling at max_lr and the best probe is the top, its steepest point, so one more
probe runs above it; on features of scale 1 the edge lies near max_lr, and the best probe is below. A curve that
turned up is probed below half its lowest point (the guard), never near it. The fits run from the state the
search started from and leave no trace.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.tuner import LRFinderResult, Tuner
from phalanx.tuner.suggest import (
    LONG_PROBE,
    PROBES,
    Suggestion,
    decide,
    fell_against,
    long_probes,
    lower_rungs,
    next_rung,
    probe_ladder,
    probe_score,
    probe_steps,
    rung_below,
    suggest,
)
from phalanx.utils.errors import PhalanxWarning
from phalanx.utils.seed import capture_rng_state, restore_rng_state


class Linear(phalanx.Module):
    """y ~ x.w + b by mean squared error, plain SGD, and a step counter (a plain attribute the search
    must put back)."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.net, self.lr, self.steps = nn.Linear(16, 1), lr, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.steps += 1
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def regression(seed: int, scaled: bool) -> DataLoader[Any]:
    """512 samples of 16 features (of scale 1, or of scales from 0.1 to 1 with ``scaled``), batches of 32."""
    g = torch.Generator().manual_seed(seed)
    scales = 10 ** -torch.rand(16, generator=g) if scaled else torch.ones(16)
    x = torch.randn(512, 16, generator=g) * scales
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(512, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def trainer(**kwargs: Any) -> phalanx.Trainer:
    return phalanx.Trainer(accelerator="cpu", enable_progress_bar=False, enable_checkpointing=False, logger=False,
                           num_sanity_val_steps=0, enable_model_summary=False, **kwargs)


def search(seed: int, scaled: bool, max_lr: float = 1.0, probe: bool = True) -> tuple[LRFinderResult, Linear]:
    phalanx.seed_everything(seed, verbose=False)
    model = Linear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the data loader's worker hint
        result = Tuner(trainer(max_epochs=1)).lr_find(model, train_dataloaders=regression(seed, scaled),
                                                      num_training=30, max_lr=max_lr, probe=probe, update_attr=False)
    return result, model


def search_on(make: Callable[[], phalanx.Module], x: torch.Tensor, y: torch.Tensor, seed: int) -> LRFinderResult:
    """A 30-step search of a module made after seeding on (x, y) in shuffled batches of 32, the probes at their
    defaults."""
    phalanx.seed_everything(seed, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the data loader's worker hint
        return Tuner(trainer(max_epochs=1)).lr_find(
            make(), train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True),
            num_training=30, update_attr=False)


def curve_only(result: LRFinderResult) -> Any:
    return suggest(result.lrs, result.raw_losses, result.mode)


def test_a_still_falling_curve_is_probed_at_below_and_above_its_steepest_point(tmp_path: Path) -> None:
    result, _ = search(0, scaled=True)
    found = curve_only(result)
    assert found.still_falling and found.lr == found.steepest == found.top and found.lowest is not None
    assert result.probe_lrs[:4] == pytest.approx([found.lr / 10 ** (k / 3) for k in (3, 2, 1, 0)])
    # The top did best: the probes go on upwards while the newest does best, within the guard.
    assert result.probe_scores[:4] == sorted(result.probe_scores[:4], reverse=True)  # the larger, the faster
    above = result.probe_lrs[4:]
    assert 1 <= len(above) <= 2 and above == pytest.approx([found.lr * 10 ** (k / 3) for k in range(1, len(above) + 1)])
    assert max(above) <= found.lowest / 2
    best = result.probe_scores.index(min(result.probe_scores))
    assert result.suggestion() == result.probe_lrs[best] and best >= 3
    result.plot().savefig(tmp_path / "lr.png")  # the probes' scores are marked
    assert (tmp_path / "lr.png").read_bytes()[:4] == b"\x89PNG"
    # Without probes the curve alone decides: its steepest point.
    assert search(0, scaled=True, probe=False)[0].suggestion() == found.lr
    assert search(0, scaled=True, probe=False)[0].probe_lrs == []


def test_a_still_falling_curve_whose_best_probe_is_below_its_steepest_point() -> None:
    result, _ = search(1, scaled=False, max_lr=1.5)
    found = curve_only(result)
    assert found.still_falling and len(result.probe_lrs) == 4 and result.probe_lrs[3] == pytest.approx(found.lr)
    assert next_rung(found, result.probe_lrs, result.probe_scores) is None  # the top did not do best: no more
    assert result.suggestion() == result.probe_lrs[2] < found.lr  # the edge of stability lies just above
    assert result.probe_scores[2] == min(result.probe_scores)


def test_a_curve_that_turned_up_is_probed_below_half_its_lowest_point() -> None:
    result, _ = search(0, scaled=False, max_lr=3.0)
    found = curve_only(result)
    assert found.lr is not None and found.lowest is not None and found.steepest is not None
    assert not found.still_falling and found.lr == min(found.steepest, found.lowest / 2)  # capped by the guard
    assert result.probe_lrs == pytest.approx([found.lowest / 2 / 10 ** (k / 3) for k in (3, 2, 1, 0)])
    assert result.suggestion() in result.probe_lrs and all(math.isfinite(s) for s in result.probe_scores)
    assert result.suggestion() == result.probe_lrs[result.probe_scores.index(min(result.probe_scores))]


HOOKS: list[str] = []  # outside the module: the search puts the module's own attributes back


class Frozen(Linear):
    """Linear whose configure_gradient_clipping zeroes every gradient (and whose other step hooks are counted):
    trained the way its hooks say, it never moves."""

    def on_after_backward(self) -> None:
        HOOKS.append("on_after_backward")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        HOOKS.append("on_before_optimizer_step")

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        HOOKS.append("configure_gradient_clipping")
        for p in self.parameters():
            assert p.grad is not None
            p.grad.zero_()


def test_the_search_steps_the_way_the_modules_hooks_say_as_the_fit_does() -> None:
    """Lightning's place for custom clipping is the Module's configure_gradient_clipping: a search that skipped
    it would measure another training than the fit's. Every batch here is the same sample, so the loss moves
    only if the weights do."""
    x, y = torch.ones(64, 16), torch.ones(64, 1)
    HOOKS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the data loader's worker hint; the flat curve's refusal
        result = Tuner(trainer(max_epochs=1)).lr_find(
            Frozen(), train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=32), num_training=10,
            probe=False, update_attr=False)
    assert len(result.raw_losses) == 10 and len(set(result.raw_losses)) == 1  # the weights never moved
    assert HOOKS == ["on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping"] * 10


def test_where_nothing_falls_the_highest_finite_probe_and_the_best_run_again_longer() -> None:
    """A model that never moves (its clipping hook zeroes the gradients) on noisy batches: the curve never falls,
    no probe does, nor a decade lower; then the highest probe (a plateau is left sooner at a larger step) and the
    best run again for LONG_PROBE times as long, and none of them falls either."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g)
    result = search_on(Frozen, x, y, seed=0)
    steps = result.probe_length
    short = [len(losses) for losses in result.probe_losses[:2 * PROBES]]
    assert short == [steps] * 2 * PROBES  # the ladder and the decade lower
    again = result.probe_lrs[2 * PROBES:]
    best = min((score, lr) for score, lr in zip(result.probe_scores[:2 * PROBES], result.probe_lrs))
    assert again == list(dict.fromkeys([max(result.probe_lrs[:2 * PROBES])] + [best[1]] * math.isfinite(best[0])))
    assert [len(losses) for losses in result.probe_losses[2 * PROBES:]] == [LONG_PROBE * steps] * len(again)
    with pytest.warns(PhalanxWarning, match=f"again for {LONG_PROBE}x as many steps"):
        assert result.suggestion() is None


class TanhRegressor(Linear):
    """A tanh MLP 8-32-32-1 on y = sin(x.a) + cos(x.b) / 2, plain SGD: in batches of 32 its loss varies so much from
    batch to batch that a 30-step search never shows a clear fall, until the last points."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def test_a_curve_that_never_fell_clearly_is_probed_below_a_quarter_of_where_the_search_ended() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 8, generator=g)
    y = torch.sin(x @ torch.randn(8, 1, generator=g) / 2) + torch.cos(x @ torch.randn(8, 1, generator=g) / 2) / 2
    result = search_on(TanhRegressor, x, y, seed=1)
    found = curve_only(result)
    assert found.lr is None and "never fell clearly" in found.reason and found.below is not None
    assert result.probe_lrs == pytest.approx([result.lrs[-1] / 4 / 10 ** (k / 3) for k in (3, 2, 1, 0)])
    best = min(result.probe_scores)
    assert best < found.below  # the probes show the fall the curve could not
    assert result.suggestion() == result.probe_lrs[result.probe_scores.index(best)]


def test_probes_leave_no_trace_a_fit_afterwards_is_the_fit_without_the_search() -> None:
    """Model, optimizer state (none yet: the fit builds it), every RNG, the module's plain attributes and
    the data order: a fit after a search with probes equals, bit for bit, one that never searched."""

    def fit(model: Linear, seed: int) -> torch.Tensor:
        t = trainer(max_epochs=2)
        t.fit(model, regression(seed, scaled=True))
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    phalanx.seed_everything(0, verbose=False)
    model = Linear(lr=0.3)
    before, rng = [p.detach().clone() for p in model.parameters()], capture_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = Tuner(trainer(max_epochs=2)).lr_find(model, train_dataloaders=regression(0, scaled=True),
                                                      num_training=30, update_attr=False)
    assert len(result.probe_lrs) == 5  # the probes ran (one above the ladder: the top did best)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)) and model.steps == 0
    draws = torch.rand(4).tolist(), random.random(), numpy.random.rand()
    restore_rng_state(rng)  # every generator where it was before the search: the same draws
    assert draws == (torch.rand(4).tolist(), random.random(), numpy.random.rand())
    restore_rng_state(rng)
    assert all(p.grad is None for p in model.parameters())
    searched = fit(model, 0)
    phalanx.seed_everything(0, verbose=False)
    assert torch.equal(searched, fit(Linear(lr=0.3), 0))


def test_the_steepest_point_lies_in_the_fall_into_the_lowest_point_not_in_a_dip_of_outlier_batches() -> None:
    """A few outlier batches early in a heavy-tailed search make a dip steeper than the true fall, which comes
    decades later; the curve climbs back above where it started in between, so the dip is noise."""
    lrs = [10 ** (-6 + k / 8) for k in range(49)]
    losses = [2.0] * 49
    losses[8:14] = [1.0, 0.8, 0.8, 0.8, 0.8, 1.0]  # the dip: steeper than the fall, two decades below it
    losses[14:17] = [2.3, 2.2, 2.1]
    losses[30:41] = [2.0 - 0.15 * k for k in range(11)]  # the fall into the lowest point
    losses[41:] = [0.6 + 0.4 * k for k in range(8)]
    found = suggest(lrs, losses, "exponential")
    assert found.steepest is not None and lrs[30] <= found.steepest <= lrs[40]


def test_the_probe_rule() -> None:
    assert probe_ladder(Suggestion(0.1, top=0.1)) == pytest.approx([0.1 / 10 ** (k / 3) for k in (3, 2, 1, 0)])
    assert probe_ladder(Suggestion(None)) == []  # too few points: no probe can help
    turned = suggest([10 ** (-4 + k / 10) for k in range(41)], [2.0 - math.tanh(k / 4 - 5) + (k > 30) * (k - 30) / 4
                                                                 for k in range(41)], "exponential")
    assert turned.lowest is not None and turned.top == turned.lowest / 2 and not turned.still_falling
    falling = suggest([10 ** (-4 + k / 10) for k in range(41)], [2.0 - k / 40 for k in range(41)], "exponential")
    assert falling.still_falling and falling.top == falling.lr == falling.steepest
    assert probe_steps(100) == 33 and probe_steps(30) == 15  # a third of the search's, at least 15 each
    assert probe_score([4.0, 3.0, 2.0, 1.0, 1.0, 1.0, 0.5, 0.5]) == 0.5  # the mean of the last quarter
    assert probe_score([1.0, 2.0, 3.0, math.nan]) == math.inf  # not finite: out
    assert probe_score([1.0, 0.5, 1.5, 2.0]) == math.inf  # ended above where it started: out
    ends = {0.3: [0.5, 0.4, 0.3, 0.3], 0.2: [0.5, 0.4, 0.2, 0.2]}  # probe losses, scored 0.3 and 0.2
    diverged, rose = [0.5, math.inf], [0.5, 0.6, 0.7, 0.8]
    chosen = decide(falling, [0.1, 0.2, 0.4], [ends[0.3], diverged, ends[0.2]], [], 4)
    assert chosen.lr == 0.4 and chosen.probed and not falling.probed
    refused = decide(falling, [0.1, 0.2, 0.4], [diverged, rose, diverged], [], 4)
    assert refused.lr is None
    assert "no probe fit below the loss curve's edge (0.1, 0.2, 0.4) ended below where it started (2 of 3 " \
        "diverged): where they ran, the loss does not fall at a constant learning rate." in refused.reason
    gone = decide(falling, [0.1, 0.2], [diverged, diverged], [], 4)
    assert gone.lr is None and "every probe fit below the loss curve's edge (0.1, 0.2) diverged. Lower min_lr" \
        in gone.reason
    # One more probe above, only where the curve was still falling and the highest so far did best.
    top = 0.01
    wide = Suggestion(top, lowest=1.0, still_falling=True, top=top)
    assert next_rung(wide, [top], [0.2]) == pytest.approx(top * 10 ** (1 / 3))
    assert next_rung(wide, [top / 2, top], [0.1, 0.2]) is None  # the top did not do best
    assert next_rung(wide, [top * 10 ** (k / 3) for k in range(6)], [1.0] * 5 + [0.1]) is None  # 2 extra at most
    assert next_rung(falling, [falling.top], [0.1]) is None  # its steepest point lies within a third of a decade
    assert next_rung(turned, [turned.lowest / 2], [0.1]) is None  # the curve turned up: the guard is the top
    near = Suggestion(top, lowest=top * 3, still_falling=True, top=top)
    assert next_rung(near, [top], [0.1]) is None  # a third of a decade up would pass the guard (lowest / 2)
    # One more below, only where the lowest did best, and clearly, on the same batches, than the rung above it.
    ladder = probe_ladder(falling)
    fast, slow_ = [1.0, 0.8, 0.6, 0.5, 0.45, 0.4, 0.38, 0.35], [1.0, 0.9, 0.8, 0.75, 0.7, 0.66, 0.63, 0.6]
    assert rung_below(falling, ladder, [fast, slow_, slow_, slow_], [], 8) == pytest.approx(ladder[0] * 10 ** (-1 / 3))
    assert rung_below(falling, ladder, [fast, diverged, diverged, diverged], [], 8) == pytest.approx(
        ladder[0] * 10 ** (-1 / 3))  # the one above diverged: as clear as it gets
    assert rung_below(falling, ladder, [slow_, fast, slow_, slow_], [], 8) is None  # the lowest did not do best
    jitter = [v * (1 + 0.02 * (-1) ** k) for k, v in enumerate(fast)]
    assert rung_below(falling, ladder, [[v * 0.999 for v in fast], jitter, slow_, slow_], [], 8) is None  # noise
    two_down = [ladder[0] * 10 ** (-k / 3) for k in (2, 1)] + ladder
    assert rung_below(falling, two_down[1:], [fast, slow_, slow_, slow_, slow_], [], 8) == pytest.approx(two_down[0])
    assert rung_below(falling, two_down, [fast] + [slow_] * 5, [], 8) is None  # 2 extra at most
    # A curve that never fell clearly: a probe must show the fall, below where the curve started (``below``)
    # or below the search's own loss on the same batches (batch noise cancels step by step).
    search = [1.0, 1.2, 0.8, 1.1, 0.9, 1.3, 0.7, 1.0]
    trained = [v * 0.8 for v in search]
    assert fell_against(trained, search) and not fell_against(search, search)
    assert not fell_against([v * 0.995 for v in search], search)  # certain, but too small a gain
    assert not fell_against([v * (0.8 if k % 2 else 1.15) for k, v in enumerate(search)], search)  # noise
    flat = Suggestion(None, "No learning rate suggested: the loss never fell clearly.", top=0.25, below=0.5)
    assert decide(flat, [0.1, 0.25], [trained, [1.0, math.inf]], search, 8).lr == 0.1  # against the search
    assert decide(flat, [0.1, 0.25], [[1.0, 0.9, 0.4, 0.4], [1.0, 0.9, 0.45, 0.45]], search, 4).lr == 0.1  # below
    # Neither: the ladder goes on a decade lower, once; then the highest that stayed finite and the best run again,
    # 4x as long, and are judged
    # against ``below`` alone.
    noisy = [v * (1 + 0.3 * (-1) ** k) for k, v in enumerate(search)]
    ladder = probe_ladder(flat)
    assert lower_rungs(flat, ladder, [noisy] * 4, search, 8) == pytest.approx(
        [flat.top * 10 ** (-k / 3) for k in range(4, 8)])
    assert lower_rungs(flat, ladder, [noisy, trained, noisy, noisy], search, 8) == []  # one shows the fall
    assert lower_rungs(falling, probe_ladder(falling), [noisy] * 4, search, 8) == []  # the curve fell
    deeper = ladder + lower_rungs(flat, ladder, [noisy] * 4, search, 8)
    assert lower_rungs(flat, deeper, [noisy] * 8, search, 8) == []  # a decade lower once
    assert decide(flat, deeper, [noisy] * 7 + [trained], search, 8).lr == deeper[-1]  # shown a decade lower
    assert rung_below(flat, deeper, [noisy] * 7 + [trained], search, 8) is None  # ahead of noisy only by noise
    untrained = [v * 1.1 for v in search]
    assert rung_below(flat, deeper, [noisy] * 6 + [untrained, trained], search, 8) == pytest.approx(
        deeper[-1] * 10 ** (-1 / 3))
    lowest_two = deeper + [deeper[-1] * 10 ** (-k / 3) for k in (1, 2)]  # the decade lower's 4 are not extra ones
    assert rung_below(flat, lowest_two, [noisy] * 8 + [untrained, trained], search, 8) is None
    assert long_probes(flat, [0.1, 0.25], [noisy, [1.0, math.inf]], search, 8) == [0.1]  # the highest finite, the best
    assert long_probes(flat, [0.1, 0.25], [trained, [1.0, math.inf]], search, 8) == []  # one shows the fall
    assert long_probes(falling, [0.1], [noisy], search, 8) == []  # the curve fell: the probes decide
    plateau = [1.0] * 4 + [1.05] * 4  # finite, ended above where it started on noise: out, but a plateau is left sooner
    assert long_probes(flat, [0.1, 0.25, 0.4], [noisy, plateau, [1.0, math.inf]], search, 8) == [0.25, 0.1]
    slow = [1.0] * 8 + [0.45] * 8
    assert long_probes(flat, [0.1, 0.25, 0.1], [noisy, [1.0, math.inf], slow], search, 8) == []  # ran already
    assert decide(flat, [0.1, 0.25, 0.1], [noisy, [1.0, math.inf], slow], search, 8).lr == 0.1
    still = decide(flat, [0.1, 0.25, 0.1], [noisy, [1.0, math.inf], [1.0] * 15 + [0.99]], search, 8)
    assert still.lr is None and still.reason == (
        "No learning rate suggested: the loss never fell clearly. No probe fit at a quarter of where the loss rose "
        "or the search ended, or below (0.1, 0.25, 0.1; 0.1 again for 4x as many steps), fell clearly either.")
    out = decide(flat, [0.1, 0.25], [[1.0, math.inf], [1.0, math.inf]], search, 8)  # nothing finite: none longer
    assert out.lr is None and out.reason.endswith("or below (0.1, 0.25), fell clearly either.")
