"""Does the LR finder's suggestion train well out of sample? Rules against a grid, on two halves of 145 families.

    .venv/bin/python bench/lr_finder.py                    # both halves, 3 seeds, num_training 30 and 100
    .venv/bin/python bench/lr_finder.py --half tuning      # only the half the rule was tuned on
    .venv/bin/python bench/lr_finder.py --set tenth        # only one set (families, second ... twelfth)
    .venv/bin/python bench/lr_finder.py --family GRU       # only the families whose name holds this (repeatable)
    .venv/bin/python bench/lr_finder.py --details          # and every case: learning rates and losses
    .venv/bin/python bench/lr_finder.py --quick            # smoke run: 2 families, 1 seed, a coarse grid
    .venv/bin/python bench/lr_finder.py --save cases.json  # and every case, the grid's losses included, as JSON

The families: the tuning half, ``TUNING`` in ``_lr_families.py`` (25), ``SECOND_SET``, ``FOURTH_SET``,
``HELD_OUT`` (the fifth set), ``SIXTH_SET``, ``SEVENTH_SET``, ``EIGHTH_SET``, ``NINTH_SET``, ``TENTH_SET`` and
``ELEVENTH_SET`` in ``_lr_second_set.py`` ... ``_lr_eleventh_set.py`` (12 each; the rule was chosen and tuned on
these 133), and the held-out half, ``TWELFTH_SET`` in ``_lr_twelfth_set.py`` (12; written by a helper who never
ran the finder, while the rule's last change was chosen on the others; its score decided nothing). For every
family and seed, an LR range test runs once per ``num_training`` (30 and the default 100; every other argument at its
default) on a real phalanx Trainer: ``Tuner(trainer).lr_find``, or for seed 002's script the
``LearningRateFinder`` callback and the fit after it, as its user ran it. Every rule in ``_lr_rules.py`` is
applied to that same curve: Lightning 2.6.6's (rebuilt from the step losses with its smoothing and early
stop), fastai's "minimum", the rules phalanx had before, phalanx's rule on the curve alone
(``lr_find(probe=False)``) and phalanx's rule as it is now (``LRFinderResult.suggestion``: the probe fits the
search ran decide).

Each suggestion is then trained the way the reference grid is: 3 epochs from the same
initialisation and the same data order (the seed), scored on the validation set. The reference is
the best of 13 learning rates, 1e-4 ... 1 (3 per decade). The bar, per half, for phalanx's rule:
within 1.5x of the grid's best at num_training=100 and 3x at 30 on at least 90 % of the half's cases
(both num_training together; each is also shown alone; a fit that ends below 2 % of the
initialisation's validation loss counts as within: on a small validation set that a fit separates the
grid's best underflows to 0, and a ratio to it measures the underflow); on every case, a finite fit
that ends below the initialisation's validation loss and within 1.5x of the fit at Lightning's
suggestion. A rule that gives no learning rate (a refusal, None) leaves the model's own, ``KEPT_LR``: the
case is scored on the fit at it, which is what the user's run trains at (``LearningRateFinder``'s fit goes
on at it; ``Tuner.lr_find`` leaves it), and the refusals are counted beside, with the bar read strictly (a
refusal failing its case) too. Fits are cached per learning rate, so rules that agree cost one fit. Needs
scikit-learn (phalanx's test extras) and torchmetrics. Threads: 1 (``OMP_NUM_THREADS=1`` is set before torch
is imported).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, table
from _lr_eighth_set import EIGHTH_SET
from _lr_eleventh_set import ELEVENTH_SET
from _lr_families import TUNING, Family, linear_regression, seed002_script
from _lr_fourth_set import FOURTH_SET
from _lr_held_out import HELD_OUT
from _lr_ninth_set import NINTH_SET
from _lr_problems import EPOCHS, GRID, KEPT_LR, find, fit, initial_loss
from _lr_rules import RULES, Curve
from _lr_second_set import SECOND_SET
from _lr_seventh_set import SEVENTH_SET
from _lr_sixth_set import SIXTH_SET
from _lr_tenth_set import TENTH_SET
from _lr_twelfth_set import TWELFTH_SET

from phalanx.tuner.suggest import probe_steps

STEPS = (100, 30)
TOLERANCE = {100: 1.5, 30: 3.0}
NOW = "phalanx now"
SHARE = 0.9  # of a half's cases within TOLERANCE of the grid's best
SEPARATED = 0.02  # of the initial loss: a fit that ends below it is within TOLERANCE, whatever the grid's best
VERSUS_LIGHTNING = 1.5
SETS = {"families": TUNING, "second": SECOND_SET, "fourth": FOURTH_SET, "fifth": HELD_OUT, "sixth": SIXTH_SET,
        "seventh": SEVENTH_SET, "eighth": EIGHTH_SET, "ninth": NINTH_SET, "tenth": TENTH_SET,
        "eleventh": ELEVENTH_SET, "twelfth": TWELFTH_SET}
HALVES = {"tuning": ["families", "second", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
                     "eleventh"],
          "held-out": ["twelfth"]}


@dataclass
class Case:
    """One family, seed and num_training: each rule's learning rate and validation loss, the references."""

    family: str
    seed: int
    n: int
    best_lr: float
    best: float
    initial: float
    lrs: dict[str, float | None] = field(default_factory=dict)  # None where the rule refused
    losses: dict[str, float] = field(default_factory=dict)  # at KEPT_LR where it refused; inf where the fit diverged
    probe_steps: int = 0  # steps of the probe fits this search ran (a diverging one stops early)
    grid: dict[float, float] = field(default_factory=dict)  # every learning rate fitted for this family and seed

    def within_grid(self, rule: str) -> bool:
        loss = self.losses[rule]
        return loss <= TOLERANCE[self.n] * self.best or loss <= SEPARATED * self.initial

    def sound(self) -> bool:
        """phalanx's fit is finite, ends below the initial loss and within 1.5x of Lightning's."""
        loss = self.losses[NOW]
        return math.isfinite(loss) and loss < self.initial and loss <= VERSUS_LIGHTNING * self.losses["Lightning 2.6.6"]

    def suggested(self) -> bool:
        return self.lrs[NOW] is not None


def run(build: Family, seed: int, grid: list[float]) -> list[Case]:
    problem = build(seed)
    losses = {lr: fit(problem, seed, lr).val_loss for lr in grid}
    best_lr = min(losses, key=lambda lr: losses[lr])
    initial = initial_loss(problem, seed)
    cases = []
    for n in STEPS:
        search = find(problem, seed, n)
        curve = Curve(search.result)
        case = Case(problem.name, seed, n, best_lr, losses[best_lr], initial,
                    probe_steps=sum(len(losses) for losses in search.result.probe_losses))
        for rule_name, rule in RULES.items():
            suggestion = case.lrs[rule_name] = rule(curve)
            lr = KEPT_LR if suggestion is None else suggestion
            if rule_name == NOW and search.fit_loss is not None:  # the script's own fit, after the callback
                losses.setdefault(lr, search.fit_loss)
            if lr not in losses:
                losses[lr] = fit(problem, seed, lr).val_loss
            case.losses[rule_name] = losses[lr]
        cases.append(case)
    for case in cases:
        case.grid = dict(losses)
    return cases


def half_tables(title: str, cases: list[Case]) -> str:
    """The rules' passes on one half, then phalanx's bar and what its probe fits cost."""
    count = {n: [c for c in cases if c.n == n] for n in STEPS}

    def refused(rule: str) -> int:
        return sum(c.lrs[rule] is None for c in cases)

    rules = table(["rule", "within 1.5x (n=100)", "within 3x (n=30)", "refused"],
                  [[rule, *(f"{sum(c.within_grid(rule) for c in count[n])} / {len(count[n])}" for n in STEPS),
                    str(refused(rule))] for rule in RULES])
    rows = []
    for n, group in [*count.items(), ("both", cases)]:
        within = sum(c.within_grid(NOW) for c in group)
        # A diverged Lightning fit counts 0.
        worst = max((c.losses[NOW] / c.losses["Lightning 2.6.6"] if math.isfinite(c.losses["Lightning 2.6.6"])
                     else 0.0 for c in group), default=0.0)
        steps = [c.probe_steps for c in group]
        rows.append([str(n), f"{within} / {len(group)} ({within / len(group):.0%})",
                     f"{sum(c.sound() for c in group)} / {len(group)}", f"{worst:.2f}x",
                     f"{sum(not c.suggested() for c in group)}",
                     f"{sum(s > 0 for s in steps)} / {len(steps)}, at most {max(steps)} steps"])
    bar = table(["n", f"within {TOLERANCE[100]}x (n=100) / {TOLERANCE[30]}x (n=30) of the grid's best",
                 "finite, below initial, <= 1.5x Lightning", "worst vs Lightning", "refused (fit at the kept lr)",
                 "searches with probe fits"], rows)
    verdicts = []
    for reading, counted in [("", cases), (", a refusal failing its case", [c for c in cases if c.suggested()])]:
        within = sum(c.within_grid(NOW) for c in counted)
        met = within >= SHARE * len(cases) and sum(c.sound() for c in counted) == len(cases)
        verdicts.append(f"phalanx now {'meets' if met else 'does NOT meet'} the bar{reading} "
                        f"(within {within} / {len(cases)}, sound {sum(c.sound() for c in counted)} / {len(cases)})")
    return f"\n{title}: {'; '.join(verdicts)}\n{rules}\n{bar}"


def details(cases: list[Case]) -> str:
    def cell(case: Case, rule: str) -> str:
        lr = case.lrs[rule]
        loss = case.losses[rule]
        where = f"{lr:.3g}" if lr is not None else f"refused, kept {KEPT_LR:g}"
        return f"{where}: {loss / case.best:.2f}x" if case.best > 0 else f"{where}: {loss:.3g} (best 0)"

    return table(["family", "seed", "n", "grid best", "initial", "Lightning 2.6.6", "phalanx now", "curve only",
                  "probe steps"],
                 [[c.family, str(c.seed), str(c.n), f"{c.best:.3g} at {c.best_lr:.3g}", f"{c.initial:.3g}",
                   cell(c, "Lightning 2.6.6"), cell(c, NOW) + ("" if c.within_grid(NOW) and c.sound() else " (!)"),
                   cell(c, "phalanx, curve only"), str(c.probe_steps)] for c in cases])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--half", choices=["tuning", "held-out", "both"], default="both")
    parser.add_argument("--set", choices=list(SETS), help="only this set of families (in its half)")
    parser.add_argument("--family", action="append", default=[], help="only families whose name holds this")
    parser.add_argument("--quick", action="store_true", help="2 tuning families, 1 seed, every other grid point")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--details", action="store_true", help="print every case's suggestions and losses")
    parser.add_argument("--save", type=Path, help="write every case (the grid's losses included) to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    halves = {half: [family for name in names for family in SETS[name]] for half, names in HALVES.items()}
    if args.half != "both":
        halves = {args.half: halves[args.half]}
    if args.set:
        half = next(h for h, names in HALVES.items() if args.set in names)
        halves = {half: SETS[args.set]}
    if args.family:
        chosen = {half: [build for build in families if any(part in build(0).name for part in args.family)]
                  for half, families in halves.items()}
        halves = {half: families for half, families in chosen.items() if families}
    seeds, grid = range(args.seeds), GRID
    if args.quick:
        halves, seeds, grid = {"tuning": [seed002_script, linear_regression]}, range(1), GRID[::2]
    start = time.time()
    results: dict[str, list[Case]] = {}
    for half, families in halves.items():
        results[half] = []
        for build in families:
            for seed in seeds:
                cases = run(build, seed, grid)
                results[half] += cases
                print(f"  [{half}] {cases[0].family}, seed {seed}: grid best {cases[0].best:.4g} at lr "
                      f"{cases[0].best_lr:.3g} ({time.time() - start:.0f} s)", flush=True)
    print(f"\n{machine_line()} | {time.time() - start:.0f} s")
    print(f"{len(seeds)} seeds; grid of {len(grid)} learning rates {grid[0]:.0e} ... {grid[-1]:.0e}; {EPOCHS}-epoch "
          f"fits; probe fits: {probe_steps(100)} steps each after a 100-step search, {probe_steps(30)} after 30")
    for rule_name, rule in RULES.items():
        print(f"  {rule_name}: {' '.join((rule.__doc__ or '').split())}")
    for half, cases in results.items():
        print(half_tables({"tuning": "Tuning half (the rule was chosen on it)",
                           "held-out": "Held-out half (never seen while tuning)"}[half], cases))
        if args.details:
            print(details(cases))
    if args.save:  # for replaying a rule on recorded fits; inf (a diverged fit) is written as JSON's Infinity
        args.save.write_text(json.dumps({half: [{**vars(c), "grid": [[lr, loss] for lr, loss in c.grid.items()]}
                                                for c in cases] for half, cases in results.items()}))


if __name__ == "__main__":
    main()
