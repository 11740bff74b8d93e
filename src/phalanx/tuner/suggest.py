"""The learning rate an LR range test suggests, or why it suggests none (``LRFinderResult.suggestion``).

The curve says where training at a rising learning rate goes fastest and where it stops going; how
far below that edge a fit of its own does best depends on the optimizer and the fit (Adam often a
decade below it, plain SGD right at it). So the curve brackets, and short fits at constant learning
rates inside the bracket (the probe fits) decide. Choices, each for a way a plain "steepest slope"
fails:

* The smoothing is centred (a Gaussian kernel over the step losses, its width a 30th of the points)
  so it does not lag. The exponential moving average the search records for its early stop trails
  the curve by about 1 / (1 - beta) = 50 steps: on a 30-step search that is the whole curve.
* log(loss) when every loss is positive: a batch's loss varies in proportion to its level, so on a
  log scale the noise is alike along the curve and a slope is a relative one.
* The noise is the step-to-step spread of the losses (median absolute difference, which a trend
  hardly moves). A curve has fallen when its lowest smoothed point lies ``NOISE_MULTIPLE`` standard
  errors below its starting level (the median of its first fifth): a flat or noise-only curve gets
  no suggestion instead of the slope of its noise.
* The guard: no suggestion lies above the lowest point's learning rate divided by ``GUARD``. Near
  its lowest point the search's loss has stopped falling; the steepest slope often lies just below it
  (a short search's curve falls over half a decade), and a fit there trains worse than chance (seed
  002's script: steepest point 0.15, lowest 0.28, the fit's best 0.01).
* The probe fits (``lr_find(probe=True)``, the default): ``PROBES`` short fits from the search's
  initial state, at constant learning rates a third of a decade apart from the top of the bracket
  down (:func:`probe_ladder`), ``max(MIN_PROBE_STEPS, num_training // 3)`` steps each
  (:func:`probe_steps`); :func:`decide` takes the one whose loss ends lowest (:func:`probe_score`).
  The top: the guard where the curve turned up; the steepest point, if lower, where it was still
  falling at its end (such a search never reached the edge, and a short probe above its steepest
  point favours a learning rate that momentum later makes unstable); and where the curve never fell
  clearly (a noisy loss, or one that stays flat until it blows up), a ``END_GUARD``-th of where it
  first rose ``NOISE_MULTIPLE`` standard errors above its start after its lowest point (the moving
  average the early stop watches trails a blow-up), or of the last learning rate the search reached
  where it never did.
* The steepest point is looked for in the fall into the lowest point (:func:`final_descent`): a dip
  that climbs back above where the curve started is a few outlier batches, however steep.
* Where the curve was still falling and the top probe did best, the optimum may lie above it: up to
  ``EXTRA_PROBES`` more, a third of a decade higher each, while the newest does best, never above
  the guard (:func:`next_rung`). Where the lowest probe did best, and clearly so against the rung above
  it on the same batches, the optimum may lie below it: as many more, a third of a decade lower each
  (:func:`rung_below`).
* Where the curve never fell clearly, a probe is suggested only if it shows the fall the curve could
  not (:func:`shows_fall`): it ended ``PROBE_NOISE_MULTIPLE`` standard errors (of the curve's noise)
  below where the curve started, or clearly below the search's own loss on the same batches
  (:func:`fell_against`: the search's first steps run from the same state with the same batches and
  dropout masks, so batch-to-batch noise cancels in the step-by-step difference). Where none does, the
  ladder goes on a decade lower (:func:`lower_rungs`): a search that never fell clearly often ran to
  ``max_lr`` without blowing up, and its last decade may lie wholly above where the model learns (a
  transformer under Adam that sits at chance for tens of steps above 1e-2 and learns at 1e-3). Where
  none of those shows a fall either, two run again for ``LONG_PROBE`` times as many steps
  (:func:`long_probes`): a loss that sits on a plateau shows its fall later than a short probe ends,
  and leaves it sooner at a larger step (the highest probe that stayed finite: an LSTM timing
  intervals sits at chance for 30 to 50 steps at its best learning rate); a learning rate that trains
  slowly is the best probe's.
* Without probe fits (``probe=False``, or a suggestion asked with other ``skip_begin``/``skip_end``
  than the search's): the steepest slope of the fall into the lowest point, capped by the guard; none
  where the curve never fell clearly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

MIN_POINTS = 8  # fewer finite losses leave no starting level and noise to measure against
NOISE_MULTIPLE = 4.0  # how many standard errors below the start the lowest point must lie
WIDTH_FRACTION = 1 / 30  # the smoothing kernel's standard deviation, as a fraction of the points
GUARD = 2.0  # a suggestion lies at or below the lowest point's learning rate divided by this
END_GUARD = 4.0  # ... or, on a curve that never fell clearly, at or below its edge (where it rose, or ended) / this
PROBES = 4  # probe fits, a third of a decade apart: together they span a decade below the top
EXTRA_PROBES = 2  # more past an end of the ladder whose probe did best: above (a still-falling curve), or below
PROBE_NOISE_MULTIPLE = 2.0  # a probe's fall, in standard errors, that stands in for the curve's
MIN_PROBE_FALL = 0.01  # ... and, against the search on the same batches, at least this (relative) fall
LONG_PROBE = 4  # where no probe of a curve that never fell clearly shows a fall, two run this much longer
MIN_PROBE_STEPS = 15  # fewer steps are mostly the first steps' transient (momentum has not built up)


@dataclass(frozen=True)
class Suggestion:
    """What the rule found: the learning rate (None with the ``reason``) and the curve it looked at."""

    lr: float | None
    reason: str = ""
    lrs: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)  # on the scale of the losses
    steepest: float | None = None  # the steepest slope's learning rate (``lr`` unless the guard capped it)
    lowest: float | None = None  # the lowest smoothed point's learning rate
    # The lowest smoothed point is at the end of the curve: the search did not reach the edge of
    # stability, so the curve cannot say how far below it the steepest point lies.
    still_falling: bool = False
    top: float | None = None  # the probe ladder's highest learning rate (None: no probe fit can help)
    # Where the curve never fell clearly: the loss the best probe fit must end below to be suggested.
    below: float | None = None
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
    if len(pairs) < MIN_POINTS and skip_begin == skip_end == 0 and all(math.isfinite(v) for v in losses):
        # Nothing blew up and the early stop waits for MIN_POINTS steps: the search was that short.
        return Suggestion(None, (
            f"No learning rate suggested: the search ran {len(losses)} steps, every loss finite, and the rule needs "
            f"{MIN_POINTS}. Raise num_training."))
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

        below = start - PROBE_NOISE_MULTIPLE * error
        # The search's early stop watches a moving average that trails the curve, so a short search runs on
        # past where its loss blew up: the edge is where the curve first rose clearly above its start after
        # its lowest point, and only where it never did, the last learning rate the search reached.
        risen = (curve[low:] >= start + NOISE_MULTIPLE * error).nonzero()
        edge = looked_at[low + int(risen[0])] if len(risen) else looked_at[-1]
        return Suggestion(None, (
            f"No learning rate suggested: the loss never fell clearly below where it started (it fell at most "
            f"{amount(fall if low > 0 else 0.0)}; with this much noise a fall takes {amount(NOISE_MULTIPLE * error)}). "
            "Widen the range (lower min_lr if the loss was already falling at the start, higher max_lr if it never "
            f"started to fall) or run more steps (num_training; this search ran {len(lrs)}), so that each learning "
            "rate is averaged over more batches."), looked_at, smoothed,
            top=edge / END_GUARD, below=math.exp(below) if log_scale else below)
    spacing = x[:low + 1].log() if mode == "exponential" else x[:low + 1]
    slope = torch.gradient(curve[:low + 1], spacing=(spacing,))[0]
    # The last two smoothing widths: within them the centred curve has no turn it could still show.
    still_falling = low >= len(y) - max(2, round(2 * width))
    descent = final_descent(curve[:low + 1], start)
    steepest, lowest = looked_at[descent + int(slope[descent:].argmin())], looked_at[low]
    lr = min(steepest, lowest / GUARD)
    return Suggestion(lr, "", looked_at, smoothed, steepest, lowest, still_falling,
                      top=lr if still_falling else lowest / GUARD)


def final_descent(curve: torch.Tensor, start: float) -> int:
    """Where the fall into the lowest point (the last of ``curve``) begins: the last point at or above the
    starting level ``start`` that the curve rose into, or 0. A dip that climbs back above where the curve
    started is noise (a few outlier batches), not the fall: its slope can be the steepest of the curve
    while the loss only falls decades later. A curve that falls from its first point rises into none, and
    its steepest point may lie anywhere."""
    rose = torch.cat([torch.tensor([False]), curve[1:-1] >= curve[:-2]])
    above = ((curve[:-1] >= start) & rose).nonzero()
    return int(above[-1]) if len(above) else 0


def probe_ladder(found: Suggestion) -> list[float]:
    """The learning rates of the probe fits for the curve ``found`` (none where no probe can help):
    ``PROBES`` of them, a third of a decade apart, up to ``found.top``."""
    if found.top is None:
        return []
    return [found.top * 10 ** (-k / 3) for k in range(PROBES - 1, -1, -1)]


def next_rung(found: Suggestion, lrs: list[float], scores: list[float]) -> float | None:
    """The learning rate of one more probe above those tried (``lrs``, ``scores``, the ladder first),
    or None: only where the curve was still falling, the highest probe so far did best, fewer than
    ``EXTRA_PROBES`` were added, and the next rung (a third of a decade up) stays within the guard."""
    if not found.still_falling or found.lowest is None or not lrs or len(lrs) >= PROBES + EXTRA_PROBES:
        return None
    finite = [(score, lr) for lr, score in zip(lrs, scores) if math.isfinite(score)]
    if not finite or min(finite)[1] != max(lrs):
        return None
    rung = max(lrs) * 10 ** (1 / 3)
    return rung if rung <= found.lowest / GUARD * (1 + 1e-9) else None


def rung_below(found: Suggestion, lrs: list[float], probes: list[list[float]], search: list[float],
               steps: int) -> float | None:
    """The learning rate of one more probe below those tried (``lrs``, ``probes``), or None: only where the
    lowest probe shows a fall, ended lowest of those that do and clearly below the probe a rung above it on
    the same batches (:func:`fell_against`; or that one diverged), and fewer than ``EXTRA_PROBES`` were added
    below the ladder (the decade lower apart: :func:`lower_rungs`). The mirror of :func:`next_rung`: the
    ladder spans a decade below the curve's bracket, and where its lowest rung does best the fit's optimum may
    lie further down (an autoencoder or a transformer under Adam whose short curve shows no clear edge). A
    lead within the batches' noise is no trend: on a plateau the short probes all end alike."""
    shown = shown_scores(found, lrs, probes, search, steps)
    if len(lrs) < 2 or not shown or min(shown)[1] != min(lrs):
        return None
    order = sorted(range(len(lrs)), key=lambda k: lrs[k])
    lowest, above = probes[order[0]], probes[order[1]]
    if all(math.isfinite(v) for v in above) and not fell_against(lowest, above):
        return None
    bottom = min(probe_ladder(found)) * (1 - 1e-9)
    added = sum(lr < bottom for lr in lrs)
    if added >= PROBES:  # the decade lower ran: its rungs are the ladder's, not extra ones
        added -= PROBES
    return min(lrs) * 10 ** (-1 / 3) if added < EXTRA_PROBES else None


def lower_rungs(found: Suggestion, lrs: list[float], probes: list[list[float]], search: list[float],
                steps: int) -> list[float]:
    """The learning rates of ``PROBES`` more probes, a decade below the ladder (``lrs``, ``probes``: the
    probes so far), or none: only where the curve never fell clearly, no probe shows a fall and the
    ladder has not gone lower yet."""
    if len(lrs) != PROBES or not none_shown(found, probes, search, steps):
        return []
    return [min(lrs) * 10 ** (-k / 3) for k in range(1, PROBES + 1)]


def probe_steps(num_training: int) -> int:
    """Steps per probe fit: a third of the search's, at least ``MIN_PROBE_STEPS``."""
    return max(MIN_PROBE_STEPS, num_training // 3)


def probe_score(losses: list[float]) -> float:
    """A probe fit's score: the mean loss of its last quarter of steps; ``inf`` (out) when a loss is not
    finite or the fit ended above where it started (the mean of its first quarter)."""
    quarter = max(1, len(losses) // 4)
    if not losses or not all(math.isfinite(v) for v in losses):
        return math.inf
    first, last = sum(losses[:quarter]) / quarter, sum(losses[-quarter:]) / quarter
    return last if last < first else math.inf


def fell_against(probe: list[float], search: list[float]) -> bool:
    """Whether the probe fit's losses over the second half of its steps lie clearly below the search's
    losses on the same steps (the same batches): by ``PROBE_NOISE_MULTIPLE`` standard errors of their
    step-by-step difference and by at least ``MIN_PROBE_FALL`` (on a log scale where every loss is
    positive, else relative to the search's mean)."""
    steps = min(len(probe), len(search))
    p = torch.tensor(probe[steps // 2:steps], dtype=torch.float64)
    s = torch.tensor(search[steps // 2:steps], dtype=torch.float64)
    if len(p) < 2 or not (torch.isfinite(p).all() and torch.isfinite(s).all()):
        return False
    if bool((p > 0).all() and (s > 0).all()):
        fall, least = s.log() - p.log(), MIN_PROBE_FALL
    else:
        fall, least = s - p, MIN_PROBE_FALL * float(s.abs().mean())
    error = float(fall.std()) / math.sqrt(len(fall))
    return float(fall.mean()) > max(PROBE_NOISE_MULTIPLE * error, least)


def shows_fall(found: Suggestion, losses: list[float], search: list[float], steps: int) -> bool:
    """Whether a probe of the curve ``found`` shows a fall: any finite probe where the curve fell
    clearly; where it never did, one that ended below ``found.below``, or one of ``steps`` steps whose
    losses fell clearly below the ``search``'s (a longer one is not compared so: the search's later
    steps ran at learning rates far from negligible)."""
    score = probe_score(losses)
    if found.below is None or not math.isfinite(score):
        return math.isfinite(score)
    return score < found.below or (len(losses) <= steps and fell_against(losses, search))


def shown_scores(found: Suggestion, lrs: list[float], probes: list[list[float]], search: list[float],
                 steps: int) -> list[tuple[float, float]]:
    """``(score, lr)`` of each probe that shows a fall (:func:`shows_fall`): those a suggestion may come from."""
    return [(probe_score(losses), lr) for lr, losses in zip(lrs, probes) if shows_fall(found, losses, search, steps)]


def none_shown(found: Suggestion, probes: list[list[float]], search: list[float], steps: int) -> bool:
    """Whether the curve ``found`` never fell clearly and none of ``probes`` shows a fall either: where the
    probes look further (:func:`lower_rungs`, :func:`long_probe`)."""
    return found.below is not None and not any(shows_fall(found, losses, search, steps) for losses in probes)


def long_probes(found: Suggestion, lrs: list[float], probes: list[list[float]], search: list[float],
                steps: int) -> list[float]:
    """The learning rates to probe again for ``LONG_PROBE * steps`` steps, or none: only where the curve
    never fell clearly, no probe shows a fall (those a decade lower included) and none ran longer yet. The
    highest whose losses all stayed finite (a plateau is left sooner at a larger step; its short probe may
    have ended above where it started on noise alone) and the best (the lowest score: one that trains
    slowly), once where they are the same."""
    if any(len(losses) > steps for losses in probes) or not none_shown(found, probes, search, steps):
        return []
    stable = [lr for lr, losses in zip(lrs, probes) if losses and all(math.isfinite(v) for v in losses)]
    scored = [(probe_score(losses), lr) for lr, losses in zip(lrs, probes)]
    finite = [(score, lr) for score, lr in scored if math.isfinite(score)]
    picks = ([max(stable)] if stable else []) + ([min(finite)[1]] if finite else [])
    return list(dict.fromkeys(picks))


def decide(found: Suggestion, lrs: list[float], probes: list[list[float]], search: list[float],
           steps: int) -> Suggestion:
    """The probe fits' verdict on the curve ``found`` (``probes``: each one's step losses, ``steps`` a
    probe's length, ``search`` the search's step losses): the learning rate of the lowest score among
    the probes that show a fall (:func:`shows_fall`; a longer one runs only where none of the others
    does); none when every probe diverged or rose, or, where the curve never fell clearly, when no
    probe shows the fall either."""
    shown = shown_scores(found, lrs, probes, search, steps)
    tried = ", ".join(f"{lr:.3g}" for lr in lrs)
    if found.below is not None and not shown:
        again = ", ".join(f"{lr:.3g}" for lr, losses in zip(lrs, probes) if len(losses) > steps)
        longer = f"; {again} again for {LONG_PROBE}x as many steps" if again else ""
        return dataclasses.replace(found, reason=(
            f"{found.reason} No probe fit at a quarter of where the loss rose or the search ended, or below "
            f"({tried}{longer}), fell clearly either."))
    if not shown:
        diverged = sum(not all(math.isfinite(v) for v in losses) for losses in probes)
        if diverged == len(probes):
            return dataclasses.replace(found, lr=None, reason=(
                f"No learning rate suggested: every probe fit below the loss curve's edge ({tried}) diverged. "
                "Lower min_lr and max_lr, or run more steps (num_training)."))
        # Where a few outlier batches made a short curve look steep, the probes ran where the loss does not move.
        return dataclasses.replace(found, lr=None, reason=(
            f"No learning rate suggested: no probe fit below the loss curve's edge ({tried}) ended below where it "
            f"started ({diverged} of {len(probes)} diverged): where they ran, the loss does not fall at a constant "
            "learning rate. Run more steps (num_training) so that each learning rate is averaged over more batches "
            "(a few outlier batches make a short curve look steep where it is not), or narrow the range (min_lr, "
            "max_lr) towards where the loss starts to fall."))
    return dataclasses.replace(found, lr=min(shown)[1], reason="", probed=True)
