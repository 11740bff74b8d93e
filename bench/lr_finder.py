"""Does the LR finder's suggestion train well? Each rule against a learning-rate grid, on six problems.

    .venv/bin/python bench/lr_finder.py             # 6 problems x 3 seeds x num_training 30 and 100
    .venv/bin/python bench/lr_finder.py --extra     # and 6 variants of them (a rule must not fit only the 6)
    .venv/bin/python bench/lr_finder.py --quick     # smoke run: 2 problems, 1 seed, a coarse grid

For every problem and seed, ``phalanx.tuner.Tuner(trainer).lr_find(...)`` runs once per
``num_training`` (30 and the default 100; every other argument at its default) on a real phalanx
Trainer. Every rule in ``_lr_rules.py`` is applied to that same curve: phalanx's rule before issue
33, Lightning 2.6.6's (with Lightning's smoothing and early stop, rebuilt from the step losses),
fastai's "valley" and "minimum", three candidates on the centred curve phalanx's rule uses,
phalanx's rule on the curve alone (``lr_find(probe=False)``) and phalanx's rule as it is now
(``LRFinderResult.suggestion``: on a curve still falling at its end, the probe fits the search ran
decide). The run also counts the searches that ran probe fits and the optimizer steps they cost.

Each suggestion is then trained the way the reference grid is: 3 epochs from the same
initialisation and the same data order (the seed), scored on the validation set. The reference is
the best of 13 learning rates, 1e-4 ... 1 (3 per decade). A suggestion passes when its validation
loss is within 1.5x of the grid's best at num_training=100, within 3x at 30. A rule that refuses
(returns None) does not pass; it is counted apart. Fits are cached per learning rate, so rules that
agree cost one fit. Problems are in ``_lr_problems.py``; the run needs scikit-learn (phalanx's test
extras) for the digits. Threads: 1 (``OMP_NUM_THREADS=1`` is set before torch is imported).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, table
from _lr_problems import EPOCHS, EXTRA, GRID, PROBLEMS, find, fit, linear_regression, mlp_4class
from _lr_rules import RULES, Curve

from phalanx.tuner.suggest import probe_steps

STEPS = (100, 30)
TOLERANCE = {100: 1.5, 30: 3.0}


Counts = dict[str, dict[str, dict[int, int]]]  # rule -> problem -> num_training -> seeds


def summary(passed: Counts, refused: Counts, problems: list[str], cases: int) -> str:
    """The issue's table: per rule, the suggestions that pass at each num_training, and the refusals."""

    def total(counts: Counts, rule: str, n: int) -> int:
        return sum(counts[rule][p][n] for p in problems)

    return table(["rule", "within 1.5x (n=100)", "within 3x (n=30)", "suggestions that train within 1.5x / 3x",
                  "refused"],
                 [[rule, f"{total(passed, rule, 100)} / {cases}", f"{total(passed, rule, 30)} / {cases}",
                   f"{total(passed, rule, 100) + total(passed, rule, 30)} / {2 * cases}",
                   str(total(refused, rule, 100) + total(refused, rule, 30))] for rule in RULES])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 problems, 1 seed, every other grid point")
    parser.add_argument("--extra", action="store_true", help="add 6 variants of the problems")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--details", action="store_true", help="print every suggestion and its validation loss")
    args = parser.parse_args()
    torch.set_num_threads(1)
    problems = PROBLEMS + (EXTRA if args.extra else [])
    seeds, grid = range(args.seeds), GRID
    if args.quick:
        problems, seeds, grid = [mlp_4class, linear_regression], range(1), GRID[::2]
    start = time.time()
    passed: Counts = {rule: {b.__name__: dict.fromkeys(STEPS, 0) for b in problems} for rule in RULES}
    refused: Counts = {rule: {b.__name__: dict.fromkeys(STEPS, 0) for b in problems} for rule in RULES}
    names: dict[str, str] = {}
    details: list[list[str]] = []
    probed = {n: [0, 0] for n in STEPS}  # num_training -> [searches that ran probe fits, their steps]
    for build in problems:
        for seed in seeds:
            problem = build(seed)
            names[build.__name__] = problem.name
            losses = {lr: fit(problem, seed, lr) for lr in grid}
            best_lr = min(losses, key=lambda lr: losses[lr])
            best = losses[best_lr]
            for n in STEPS:
                curve = Curve(find(problem, seed, n))
                if curve.result.probe_lrs:
                    probed[n][0] += 1
                    probed[n][1] += len(curve.result.probe_lrs) * probe_steps(n)
                for rule_name, rule in RULES.items():
                    lr = rule(curve)
                    if lr is None:
                        refused[rule_name][build.__name__][n] += 1
                        details.append([problem.name, str(seed), str(n), rule_name, "refused", "", ""])
                        continue
                    if lr not in losses:
                        losses[lr] = fit(problem, seed, lr)
                    ok = math.isfinite(losses[lr]) and losses[lr] <= TOLERANCE[n] * best
                    passed[rule_name][build.__name__][n] += ok
                    details.append([problem.name, str(seed), str(n), rule_name, f"{lr:.3g}",
                                    f"{losses[lr] / best:.3g}", "yes" if ok else "no"])
            print(f"  {problem.name}, seed {seed}: grid best {best:.4g} at lr {best_lr:.3g} "
                  f"({time.time() - start:.0f} s)", flush=True)
    print(f"\n{machine_line()} | {time.time() - start:.0f} s")
    print(f"{len(problems)} problems x {len(seeds)} seeds; grid of {len(grid)} learning rates "
          f"{grid[0]:.0e} ... {grid[-1]:.0e}; {EPOCHS}-epoch fits; passes: within 1.5x of the grid's best "
          "validation loss at num_training=100, within 3x at 30")
    for rule_name, rule in RULES.items():
        print(f"  {rule_name}: {' '.join((rule.__doc__ or '').split())}")
    for n, (searches, steps) in probed.items():
        print(f"  probe fits at num_training={n}: in {searches} of {len(problems) * len(seeds)} searches, "
              f"{steps / max(searches, 1):.0f} optimizer steps each")
    if args.details:
        print(table(["problem", "seed", "n", "rule", "lr", "val / grid best", "passes"], details))
    for title, group in (("the problems", [b.__name__ for b in problems if b not in EXTRA]),
                         ("the variants (--extra)", [b.__name__ for b in problems if b in EXTRA])):
        if group:
            print(f"\n{title}:\n{summary(passed, refused, group, len(group) * len(seeds))}")
    print("\nPer problem: seeds passing at n=100 / at n=30, refusals in brackets")
    print(table(["problem", *RULES], [[name, *(
        f"{passed[rule][key][100]} / {passed[rule][key][30]}"
        + (f" ({refused[rule][key][100]} / {refused[rule][key][30]})" if refused[rule][key][100]
           + refused[rule][key][30] else "") for rule in RULES)] for key, name in names.items()]))


if __name__ == "__main__":
    main()
