"""What surviving interruptions costs: signal-to-exit, restart-to-first-step, and snapshots per step.

    python bench/survival.py [--steps 40] [--sizes main,large]

Each case runs a real 2-rank Trainer fit (DDP, gloo, CPU) under ``python job.py`` (phalanx's launcher):

* **snapshot cost**: the median step time with ``Snapshot(every_n_train_steps=1)`` against without, for
  the main job's model (the digits MLP, 64-128-10) and a larger MLP (``--large-hidden``, Adam: the
  snapshot holds weights and two moments);
* **signal to exit**: SIGTERM to the launching process (or to rank 1) after step 5, until the launcher
  has exited with code 75 and the checkpoint is complete;
* **restart to first step**: SIGKILL of rank 1 after step 5 under ``max_restarts=1`` with snapshots,
  until the restarted attempt finishes its first step.
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
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

JOB = textwrap.dedent('''
    import json, os, sys, time, torch, phalanx
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    hidden, steps, snapshot, restarts = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

    class Clock:
        """Rank 0 appends (attempt, step, time) after each optimizer step, before the other callbacks run."""
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            with open(f"pid{trainer.global_rank}", "w") as fh:
                fh.write(str(os.getpid()))
            if trainer.global_rank == 0:
                with open("clock.jsonl", "a") as fh:
                    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                    fh.write(json.dumps([attempt, trainer.global_step, time.time()]) + "\\n")

    class MLP(phalanx.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                     nn.Linear(hidden, 10))
        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    callbacks = [Clock()] + ([phalanx.callbacks.Snapshot(every_n_train_steps=snapshot)] if snapshot else [])
    trainer = phalanx.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, logger=False,
                              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                              callbacks=callbacks, max_restarts=restarts, default_root_dir="run")
    trainer.fit(MLP(), DataLoader(data, batch_size=32, shuffle=True))
''')


def _start(folder: Path, hidden: int, steps: int, snapshot: int, restarts: int) -> subprocess.Popen[bytes]:
    (folder / "job.py").write_text(JOB)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PHALANX_SHOW_TRACEBACKS": "0"}
    return subprocess.Popen([sys.executable, "job.py", str(hidden), str(steps), str(snapshot), str(restarts)],
                            cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _clock(folder: Path) -> list[tuple[int, int, float]]:
    path = folder / "clock.jsonl"
    if not path.exists():
        return []
    return [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]  # type: ignore[misc]


def _wait_step(folder: Path, proc: subprocess.Popen[bytes], step: int, attempt: int = 0) -> float:
    deadline = time.monotonic() + 300
    while True:
        hit = [t for a, s, t in _clock(folder) if a == attempt and s >= step]
        if hit:
            return hit[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            raise RuntimeError(f"the job ended before step {step}: {tail}")
        time.sleep(0.005)


def step_time(hidden: int, steps: int, snapshot: int) -> float:
    """Mean step time after warm-up (the mean, so a snapshot every n steps counts once per n steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        proc = _start(folder, hidden, steps, snapshot, 0)
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(proc.stderr.read().decode()[-2000:] if proc.stderr else "failed")
        times = [t for _, _, t in _clock(folder)][5:]  # after warm-up
        return statistics.mean(b - a for a, b in itertools.pairwise(times))


def signal_to_exit(hidden: int, target: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        proc = _start(folder, hidden, 100000, 0, 0)
        _wait_step(folder, proc, 5)
        pid = proc.pid if target == "launcher" else int((folder / "pid1").read_text())
        start = time.time()
        os.kill(pid, signal.SIGTERM)
        code = proc.wait(timeout=300)
        took = time.time() - start
        if code != 75 or not (folder / "run" / "checkpoints" / "last.ckpt").exists():
            raise RuntimeError(f"exit {code}: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        return took


def restart_to_first_step(hidden: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        proc = _start(folder, hidden, 60, 1, 1)
        _wait_step(folder, proc, 5)
        killed = time.time()
        os.kill(int((folder / "pid1").read_text()), signal.SIGKILL)
        first = _wait_step(folder, proc, 0, attempt=1)
        proc.wait(timeout=600)
        return first - killed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--large-hidden", type=int, default=1536)
    args = p.parse_args()
    sizes = {"main job (64-128-10)": 128, f"larger MLP (64-{args.large_hidden}-10)": args.large_hidden}
    print(f"torch {__import__('torch').__version__}, {os.cpu_count()} CPU cores, 2 ranks (DDP, gloo)\n")
    print("| model | params | step (ms) | with Snapshot every step (ms) | cost | every 10 steps (ms) | cost |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, hidden in sizes.items():
        params = 64 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10
        plain, every, tenth = (step_time(hidden, args.steps, n) for n in (0, 1, 10))
        print(f"| {name} | {params / 1e6:.2f} M | {plain * 1e3:.1f} | {every * 1e3:.1f} | "
              f"{(every / plain - 1) * 100:+.1f} % | {tenth * 1e3:.1f} | {(tenth / plain - 1) * 100:+.1f} % |")
    print("\n| event | model | seconds |")
    print("| --- | --- | ---: |")
    for name, hidden in sizes.items():
        for target, who in (("launcher", "the launcher"), ("rank", "rank 1")):
            took = signal_to_exit(hidden, target)
            print(f"| SIGTERM to {who} -> exit 75, checkpoint written | {name} | {took:.2f} |")
        print(f"| kill -9 of rank 1 -> first step of the restarted attempt | {name} | "
              f"{restart_to_first_step(hidden):.2f} |")


if __name__ == "__main__":
    main()
