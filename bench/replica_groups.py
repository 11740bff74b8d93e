"""What a dead rank costs: fault-tolerant replica groups (torchft) against today's restart of every rank.

    python bench/replica_groups.py [--cases main,mlp] [--reps 3] [--kill-after 10]

Both runs train the same models as bench/survival.py (the main job, examples/train_digits.py's model and data, and
the larger MLP, Adam, batch 32 per process), 2 processes on this machine, the Trainer, CPU, gloo:

* **today's restart**: ``python job.py`` with ``devices=2`` (DDP), ``max_restarts=1`` and a snapshot every step; one
  rank killed with SIGKILL after step ``--kill-after``: every rank stops, the restarted attempt resumes from the
  snapshot. Lost: the time from the kill to the restarted attempt's first step (the whole job waits), plus the steps
  recomputed (those since the newest snapshot: at most one here).
* **replica groups**: ``phalanx run --replica-groups 2 --max-restarts 1`` (one process per group); group 1's rank
  killed after the same step. The other group goes on: lost is the longest pause between two of its steps around
  the kill, minus its median step; it recomputes nothing; group 1's share of the steps it was out (and healing) is
  skipped (samples, counted by the job), and the time until it took part again is shown.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import survival  # bench/ is not a package: the same models and job as the survival bench

REPO = survival.REPO
# The survival bench's job, each replica group writing its own clock and pid files.
GROUP = "os.environ.get('REPLICA_GROUP_ID', '0')"
JOB = survival.JOB.replace('open(f"pid{trainer.global_rank}", "w")',
                           f'open(f"pid{{trainer.global_rank}}-g{{{GROUP}}}", "w")')
JOB = JOB.replace('open("clock.jsonl", "a")', f'open(f"clock-g{{{GROUP}}}.jsonl", "a")')
JOB = JOB.replace('default_root_dir="run")', 'default_root_dir="run-g" + os.environ.get("REPLICA_GROUP_ID", "0"))')
# Each group keeps its own checkpoint folder (one run per folder: docs/faults.md, replica groups' limits).
JOB = JOB.replace('dirpath="ckpts"', 'dirpath="ckpts-g" + os.environ.get("REPLICA_GROUP_ID", "0")')
JOB += '''
groups = trainer.fabric.replica_groups
if groups is not None and trainer.global_rank == 0:
    with open(f"tally-g{groups.env.group}.json", "w") as fh:
        json.dump(groups.tally.state_dict(), fh)
'''


def _clock(path: Path) -> list[tuple[int, int, float]]:
    if not path.exists():
        return []
    return [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _wait(path: Path, proc: subprocess.Popen[bytes], step: int, attempt: int = 0) -> float:
    deadline = time.monotonic() + 600
    while True:
        hit = [t for a, s, t in _clock(path) if a == attempt and s >= step]
        if hit:
            return hit[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            raise RuntimeError(f"the job ended before step {step}: {tail}")
        time.sleep(0.005)


def _pid(path: Path) -> int:
    """A pid file's number (the job rewrites it every step: retry while it is being written)."""
    for _ in range(200):
        text = path.read_text().strip()
        if text:
            return int(text)
        time.sleep(0.005)
    raise RuntimeError(f"{path} stays empty")


def every_rank_restarts(hidden: int) -> float:
    """Today's path, as bench/survival.py times it: 2 DDP ranks, a snapshot every step, rank 1 killed after step 5;
    the seconds until the restarted attempt's first step."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        proc = survival._start(folder, hidden, 60, 1, 1)
        _wait(folder / "clock.jsonl", proc, 5)
        killed = time.time()
        os.kill(_pid(folder / "pid1"), signal.SIGKILL)
        first = _wait(folder / "clock.jsonl", proc, 0, attempt=1)
        proc.wait(timeout=600)
        return first - killed


def replica_groups(hidden: int, steps: int, kill_after: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "job.py").write_text(JOB)
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PHALANX_SHOW_TRACEBACKS": "0"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx.cli", "run", "--replica-groups", "2", "--max-restarts", "1", "job.py",
             str(hidden), str(steps), "0", "0", str(REPO / "examples"), "1"],
            cwd=folder, env=env, stdout=(folder / "launcher.log").open("w"), stderr=subprocess.STDOUT)
        _wait(folder / "clock-g1.jsonl", proc, kill_after)
        killed = time.time()
        os.kill(_pid(folder / "pid0-g1"), signal.SIGKILL)
        back = _wait(folder / "clock-g1.jsonl", proc, 0, attempt=1)
        code = proc.wait(timeout=900)
        if code != 0:
            raise RuntimeError(f"exit {code}: {(folder / 'launcher.log').read_text()[-4000:]}")
        survivor = _clock(folder / "clock-g0.jsonl")
        times = [t for _, _, t in survivor]
        steps_seen = [s for _, s, _ in survivor]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        median = statistics.median(gaps)
        around = [b - a for a, b in itertools.pairwise(times) if b >= killed - 0.5 and a <= back + 5]
        tally = json.loads((folder / "tally-g0.json").read_text())
        return {"lost": max(around, default=median) - median, "step": median, "back": back - killed,
                "recomputed": float(len(steps_seen) - len(set(steps_seen))), "skipped": float(tally["skipped"]),
                "trained": float(tally["trained"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="main,mlp")
    p.add_argument("--large-hidden", type=int, default=1536)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kill-after", type=int, default=10)
    p.add_argument("--steps", default="main=3000,mlp=500",
                   help="steps per case: the live group must still be training when the killed one is back")
    args = p.parse_args()
    cases = {"main": ("main job (examples/train_digits.py)", 0),
             "mlp": (f"larger MLP (64-{args.large_hidden}-{args.large_hidden}-10, Adam, batch 32)", args.large_hidden)}
    print(f"torch {__import__('torch').__version__}, {os.cpu_count()} CPU cores, 2 processes, median of {args.reps}\n")
    print("| model | today: every rank restarts (s lost, whole job) | steps recomputed | replica groups: the live "
          "group loses (s) | steps recomputed | the killed group takes part again after (s) | samples skipped |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    survival.DEVICES[0] = 2
    for key in args.cases.split(","):
        name, hidden = cases[key.strip()]
        today = [every_rank_restarts(hidden) for _ in range(args.reps)]
        steps = int(dict(pair.split("=") for pair in args.steps.split(","))[key.strip()])
        ft = [replica_groups(hidden, steps, args.kill_after) for _ in range(args.reps)]
        med = {k: statistics.median(r[k] for r in ft) for k in ft[0]}
        print(f"| {name} | {statistics.median(today):.2f} | <= 1 (a snapshot every step) | {med['lost']:.2f} | "
              f"{med['recomputed']:.0f} | {med['back']:.2f} | {med['skipped']:.0f} of "
              f"{med['trained'] + med['skipped']:.0f} |")


if __name__ == "__main__":
    main()
