"""The learning rate an LR range test suggests, or why it suggests none (``LRFinderResult.suggestion``).

The rule: the steepest descent of the smoothed log-loss against log(lr) before the curve's lowest
point; no suggestion when that lowest point is not clearly below the loss the curve started at.
Choices, each for a way a plain "steepest slope" fails:

* The smoothing is centred (a Gaussian kernel over the step losses, its width a 30th of the points)
  so it does not lag. The exponential moving average the search records for its early stop trails
  the curve by about 1 / (1 - beta) = 50 steps: on a 30-step search that is the whole curve.
* log(loss) when every loss is positive: a batch's loss varies in proportion to its level, so on a
  log scale the noise is alike along the curve and a slope is a relative one.
* The noise is the step-to-step spread of the losses (median absolute difference, which a trend
  hardly moves). A curve has fallen when its lowest smoothed point lies ``NOISE_MULTIPLE`` standard
  errors below its starting level (the median of its first fifth): a flat or noise-only curve gets
  no suggestion instead of the slope of its noise.
* Only before the lowest point: after it the loss turns up (divergence), and a spike that recovers
  there falls steeply without being a descent.
* A curve still falling at its end never reached the edge of stability, so it does not say on which
  side of its steepest point training goes best (plain SGD trains best above it, momentum below):
  ``lr_find`` then runs short probe fits around that point (``probe_ladder``, ``probe_steps``) and
  :func:`decide` takes the best by :func:`probe_score`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

MIN_POINTS = 8  # fewer finite losses leave no starting level and noise to measure against
NOISE_MULTIPLE = 4.0  # how many standard errors below the start the lowest point must lie
WIDTH_FRACTION = 1 / 30  # the smoothing kernel's standard deviation, as a fraction of the points
PROBE_FACTORS = (0.5, 1.0, 2.0)  # the probe fits' learning rates, as multiples of the steepest point
MIN_PROBE_STEPS = 15  # fewer steps are mostly the first steps' transient (momentum has not built up)


@dataclass(frozen=True)
class Suggestion:
    """What the rule found: the learning rate (None with the ``reason``) and the curve it looked at."""

    lr: float | None
    reason: str = ""
    lrs: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)  # on the scale of the losses
    # The lowest smoothed point is at the end of the curve: the search did not reach the edge of
    # stability, so the curve cannot say how far below it the steepest point lies (probe fits decide).
    still_falling: bool = False
    probed: bool = False  # ``lr`` is the probe fits' choice (:func:`decide`)


def smooth(values: torch.Tensor, width: float) -> torch.Tensor:
    """Centred Gaussian smoothing (standard deviation ``width`` points); near the ends the kernel is
    cut off and renormalised, so the first and last points are not pulled towards zero."""
    radius = math.ceil(3 * width)
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-0.5 * (offsets / width) ** 2).view(1, 1, -1)

    def convolve(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv1d(x.view(1, 1, -1), kernel, padding=radius).view(-1)

    return convolve(values) / convolve(torch.ones_like(values))


def noise(values: torch.Tensor) -> float:
    """The standard deviation of one point around the trend, from the median absolute step."""
    return 1.4826 * float((values[1:] - values[:-1]).abs().quantile(0.5)) / math.sqrt(2)


def suggest(lrs: list[float], losses: list[float], mode: str, skip_begin: int = 0, skip_end: int = 0) -> Suggestion:
    """The rule above on the step losses ``losses`` recorded at ``lrs`` (``mode`` as in ``lr_find``)."""
    end = len(losses) - skip_end
    pairs = [(lr, loss) for lr, loss in zip(lrs[skip_begin:end], losses[skip_begin:end]) if math.isfinite(loss)]
    if len(pairs) < MIN_POINTS:
        return Suggestion(None, (
            f"No learning rate suggested: {len(pairs)} finite losses remain after skip_begin={skip_begin} and "
            f"skip_end={skip_end}, and the rule needs {MIN_POINTS}. Run more steps (num_training), or start lower "
            "(min_lr) if the loss blew up early."))
    x = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    y = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    log_scale = bool((y > 0).all())
    if log_scale:
        y = y.log()
    width = max(1.0, len(y) * WIDTH_FRACTION)
    curve = smooth(y, width)
    low = int(curve.argmin())
    head = max(3, len(y) // 5)
    start = float(y[:head].quantile(0.5))
    # Standard errors of the smoothed lowest point (a Gaussian-weighted mean of `width`-spaced points)
    # and of the median of the first `head` points.
    error = noise(y) * math.sqrt(1 / (2 * math.sqrt(math.pi) * width) + math.pi / (2 * head))
    fall = start - float(curve[low])
    smoothed = (curve.exp() if log_scale else curve).tolist()
    looked_at = x.tolist()
    if low == 0 or fall < NOISE_MULTIPLE * error:
        def amount(v: float) -> str:
            return f"{100 * (1 - math.exp(-max(v, 0.0))):.1f}%" if log_scale else f"{max(v, 0.0):.3g}"

        return Suggestion(None, (
            f"No learning rate suggested: the loss never fell clearly below where it started (it fell at most "
            f"{amount(fall if low > 0 else 0.0)}; with this much noise a fall takes {amount(NOISE_MULTIPLE * error)}). "
            "Widen the range (lower min_lr if the loss was already falling at the start, higher max_lr if it never "
            f"started to fall) or run more steps (num_training; this search ran {len(lrs)}), so that each learning "
            "rate is averaged over more batches."), looked_at, smoothed)
    spacing = x[:low + 1].log() if mode == "exponential" else x[:low + 1]
    slope = torch.gradient(curve[:low + 1], spacing=(spacing,))[0]
    # The last two smoothing widths: within them the centred curve has no turn it could still show.
    still_falling = low >= len(y) - max(2, round(2 * width))
    return Suggestion(looked_at[int(slope.argmin())], "", looked_at, smoothed, still_falling)


def probe_ladder(steepest: float, max_lr: float) -> list[float]:
    """The learning rates the probe fits try around a still-falling curve's steepest point, capped at
    ``max_lr`` (the range the user allowed); duplicates after the cap are dropped."""
    return sorted({min(steepest * f, max_lr) for f in PROBE_FACTORS})


def probe_steps(num_training: int) -> int:
    """Steps per probe fit: together the probes cost about the search again."""
    return max(MIN_PROBE_STEPS, num_training // len(PROBE_FACTORS))


def probe_score(losses: list[float]) -> float:
    """A probe fit's score: the mean loss of its last quarter of steps; ``inf`` (out) when a loss is not
    finite or the fit ended above where it started (the mean of its first quarter)."""
    quarter = max(1, len(losses) // 4)
    if not losses or not all(math.isfinite(v) for v in losses):
        return math.inf
    first, last = sum(losses[:quarter]) / quarter, sum(losses[-quarter:]) / quarter
    return last if last < first else math.inf


def decide(found: Suggestion, lrs: list[float], scores: list[float]) -> Suggestion:
    """The probe fits' verdict on a still-falling curve: the learning rate of the lowest score; none
    when every probe diverged or rose."""
    finite = [(score, lr) for lr, score in zip(lrs, scores) if math.isfinite(score)]
    if not finite:
        return dataclasses.replace(found, lr=None, reason=(
            "No learning rate suggested: the loss was still falling at max_lr, and every probe fit around its "
            f"steepest point ({', '.join(f'{lr:.3g}' for lr in lrs)}) diverged or ended above where it started. "
            "Lower max_lr, or run more steps (num_training)."))
    return dataclasses.replace(found, lr=min(finite)[1], probed=True)
