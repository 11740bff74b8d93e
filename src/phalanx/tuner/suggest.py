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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MIN_POINTS = 8  # fewer finite losses leave no starting level and noise to measure against
NOISE_MULTIPLE = 4.0  # how many standard errors below the start the lowest point must lie
WIDTH_FRACTION = 1 / 30  # the smoothing kernel's standard deviation, as a fraction of the points


@dataclass(frozen=True)
class Suggestion:
    """What the rule found: the learning rate (None with the ``reason``) and the curve it looked at."""

    lr: float | None
    reason: str = ""
    lrs: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)  # on the scale of the losses


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
    return Suggestion(looked_at[int(slope.argmin())], "", looked_at, smoothed)
