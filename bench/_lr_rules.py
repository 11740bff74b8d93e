"""Suggestion rules for ``bench/lr_finder.py``, each a function of one recorded LR-finder curve.

Every rule sees the same curve: the learning rates phalanx's finder tried, the moving average of the
loss it records (``LRFinderResult.losses``) and the loss of each step (``LRFinderResult.raw_losses``).
A rule returns a learning rate, or None where it refuses to suggest one. The rules of other projects
are written here from their documented behaviour: none of their code is used.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from phalanx.tuner import LRFinderResult
from phalanx.tuner.suggest import WIDTH_FRACTION, smooth, suggest


@dataclass
class Curve:
    result: LRFinderResult

    @property
    def lrs(self) -> list[float]:
        return self.result.lrs

    @property
    def average(self) -> list[float]:
        """The moving average phalanx records (beta 0.98, bias-corrected)."""
        return self.result.losses

    @property
    def raw(self) -> list[float]:
        return self.result.raw_losses


def phalanx_before(curve: Curve, skip_begin: int = 10, skip_end: int = 1) -> float | None:
    """phalanx before issue 33: the steepest slope of the moving average against log(lr)."""
    end = len(curve.average) - skip_end
    pairs = [(lr, loss) for lr, loss in zip(curve.lrs[skip_begin:end], curve.average[skip_begin:end])
             if math.isfinite(loss)]
    if len(pairs) < 3:
        return None
    lrs = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    slope = torch.gradient(torch.tensor([p[1] for p in pairs], dtype=torch.float64), spacing=(lrs.log(),))[0]
    return float(lrs[int(slope.argmin())])


def lightning_losses(raw: list[float], threshold: float = 4.0, beta: float = 0.98) -> list[float]:
    """The curve Lightning 2.6.6 records from the same step losses. Its bias correction divides by
    1 - beta**(global_step + 1) where global_step already counts the step just taken (so the first
    smoothed value is about half the loss), and it stops once the smoothed loss exceeds ``threshold``
    times the best after the first step. Its correction shrinks the early values most, so it stops
    no later than phalanx's search (which recorded ``raw``) did: the whole of its curve is here. On
    a non-finite loss it does not stop, but the later values are non-finite too, and its rule drops
    them."""
    out: list[float] = []
    average, best = 0.0, 0.0
    for step, loss in enumerate(raw, start=1):
        average = beta * average + (1 - beta) * loss
        smoothed = average / (1 - beta ** (step + 1))
        out.append(smoothed)
        if step > 1 and smoothed > threshold * best:
            break
        if smoothed < best or step == 1:
            best = smoothed
    return out


def lightning(curve: Curve, skip_begin: int = 10, skip_end: int = 1) -> float | None:
    """Lightning 2.6.6's rule: the steepest gradient of its smoothed loss against the learning rate itself."""
    losses = lightning_losses(curve.raw)
    lrs = curve.lrs[:len(losses)]
    pairs = [(lr, loss) for lr, loss in zip(lrs[skip_begin:-skip_end], losses[skip_begin:-skip_end])
             if math.isfinite(loss)]
    if len(pairs) < 2:
        return None
    x = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    gradient = torch.gradient(torch.tensor([p[1] for p in pairs], dtype=torch.float64), spacing=[x])[0]
    return pairs[int(gradient.argmin())][0]


def minimum_over_10(curve: Curve) -> float | None:
    """fastai's "minimum": the learning rate of the lowest moving average, divided by 10."""
    finite = [(loss, lr) for lr, loss in zip(curve.lrs, curve.average) if math.isfinite(loss)]
    return min(finite)[1] / 10 if finite else None


def _centred(curve: Curve) -> tuple[list[float], torch.Tensor]:
    """The finite step losses and their centred smoothing on a log scale, as phalanx's rule has them."""
    pairs = [(lr, loss) for lr, loss in zip(curve.lrs, curve.raw) if math.isfinite(loss)]
    y = torch.tensor([p[1] for p in pairs], dtype=torch.float64).log()
    return [p[0] for p in pairs], smooth(y, max(1.0, len(y) * WIDTH_FRACTION))


def lowest_over_2(curve: Curve) -> float | None:
    """The learning rate of the centred curve's lowest point, halved (the fit's best learning rate lies
    just below the edge of stability for plain SGD; the lowest point is near that edge)."""
    lrs, centred = _centred(curve)
    return lrs[int(centred.argmin())] / 2 if len(lrs) >= 3 else None


def steepest_centred(curve: Curve) -> float | None:
    """Issue 33's rule on a curve that turned up (it ran probe fits only on curves still falling at their
    end), without its refusal: the steepest slope of the centred curve against log(lr) before its lowest
    point, whatever the noise."""
    lrs, centred = _centred(curve)
    low = int(centred.argmin())
    if low < 1:
        return None
    x = torch.tensor(lrs[:low + 1], dtype=torch.float64).log()
    return lrs[int(torch.gradient(centred[:low + 1], spacing=(x,))[0].argmin())]


def phalanx_curve_only(curve: Curve) -> float | None:
    """phalanx's rule on the curve alone (``lr_find(probe=False)``): the steepest slope of the centred
    curve before its lowest point, at most half the lowest point's learning rate (the guard); none when
    that point is not 4 standard errors below the start."""
    return suggest(curve.lrs, curve.raw, curve.result.mode).lr


def phalanx_now(curve: Curve) -> float | None:
    """phalanx's rule (``LRFinderResult.suggestion()`` in this checkout): the best of the probe fits the
    search ran inside the curve's bracket (4, a third of a decade apart, max(15, num_training // 3)
    steps each, the highest at half the lowest point's learning rate, or at the steepest point where
    the curve was still falling, and then up to 2 more above while the highest does best, within half
    the lowest point's, or below while the lowest does best clearly; a quarter of where the curve rose
    clearly after its lowest point, or of the last learning rate, where it never fell clearly, a probe
    suggested there only if it fell below where the curve started or below the search on the same
    batches, else 4 more a decade lower, else the best again for twice as many steps)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a refusal is counted, its message is for users
        return curve.result.suggestion()


# Short names for the tables; each function's docstring says what it does.
RULES: dict[str, Callable[[Curve], float | None]] = {
    "Lightning 2.6.6": lightning,
    "phalanx before issue 33": phalanx_before,
    "fastai minimum": minimum_over_10,
    "lowest / 2": lowest_over_2,
    "issue 33 (steepest, centred)": steepest_centred,
    "phalanx, curve only": phalanx_curve_only,
    "phalanx now": phalanx_now,
}
