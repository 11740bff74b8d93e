"""Wall time of a short 2-rank job, phase by phase: what a user waits for besides the training itself.

    .venv/bin/python bench/startup.py [--reps 5]

The job is ``python job.py`` with ``Fabric(devices=2, strategy="ddp").launch()``: the launching process
starts two ranks through torch's elastic agent, each sets up a small model and optimizer, trains three
steps and exits. Each phase ends at a timestamp the processes write:

* launcher imported: ``import torch, phalanx`` in the launching process;
* ranks imported: the later rank's ``import torch, phalanx``;
* set up: the later rank's ``fabric.setup`` returned (creating the optimizer imports torch._dynamo);
* trained: the later rank finished three steps;
* ranks exited: the last atexit handler of the later rank ran;
* launcher exited: the launching process is gone.

Runs alternate with a baseline where ``phalanx.utils.exiting.freeze_at_exit`` does nothing, i.e. every
process ends with CPython's final garbage collection (what it did before). Medians over ``--reps``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, machine_line, table

JOB = textwrap.dedent('''
    import atexit, os, sys, time
    NAME = os.environ.get("RANK", "launcher")
    def stamp(what):
        with open(f"stamps-{NAME}", "a") as fh:
            fh.write(f"{what} {time.time()}\\n")
    atexit.register(stamp, "exited")  # first registered: runs last
    import torch, phalanx, phalanx.utils.exiting
    stamp("imported")
    if os.environ.get("BASELINE") == "1":  # the final collection as before
        phalanx.utils.exiting.freeze_at_exit = lambda: None
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    model = torch.nn.Linear(16, 4)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stamp("setup")
    for _ in range(3):
        fabric.backward(model(torch.randn(8, 16)).sum())
        optimizer.step()
        optimizer.zero_grad()
    stamp("trained")
''')

PHASES = ["launcher imported", "ranks imported", "set up", "trained", "ranks exited", "launcher exited"]


def run_once(baseline: bool) -> list[float]:
    """Seconds from the start to the end of each phase."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "job.py").write_text(JOB)
        env = {**os.environ, "BASELINE": "1" if baseline else "0", "PYTHONPATH": str(REPO / "src")}
        start = time.time()
        subprocess.run([sys.executable, "job.py"], cwd=folder, env=env, check=True, capture_output=True)
        end = time.time()
        stamps: dict[str, dict[str, float]] = {}
        for path in folder.glob("stamps-*"):
            name = path.name.removeprefix("stamps-")
            stamps[name] = {line.split()[0]: float(line.split()[1]) for line in path.read_text().splitlines()}
        ranks = [stamps["0"], stamps["1"]]
        points = [stamps["launcher"]["imported"], *(max(r[what] for r in ranks)
                                                   for what in ("imported", "setup", "trained", "exited")), end]
        return [p - start for p in points]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    runs: dict[bool, list[list[float]]] = {False: [], True: []}
    for _ in range(args.reps):
        for baseline in (True, False):  # alternated: drift on a shared machine hits both
            runs[baseline].append(run_once(baseline))
    print(machine_line())
    print(f"2-rank DDP job (launch, setup, 3 steps, exit), median of {args.reps} alternated runs, seconds from start")
    rows = []
    for i, phase in enumerate(PHASES):
        before = statistics.median(r[i] for r in runs[True])
        now = statistics.median(r[i] for r in runs[False])
        rows.append([phase, f"{before:.2f}", f"{now:.2f}"])
    print(table(["phase ends", "final GC at exit", "skipped (phalanx)"], rows))


if __name__ == "__main__":
    main()
