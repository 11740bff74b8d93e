"""What surviving interruptions costs: snapshots (the default cadence and every step), signal-to-exit,
restart-to-first-step.

    python bench/survival.py [--steps 300] [--reps 3] [--only-snapshots] [--cases main,mlp,lm] [--devices 2]
                             [--busy N]

Each case runs a real Trainer fit (``--devices`` ranks, DDP, gloo, CPU) under ``python job.py`` (phalanx's
launcher):

* **snapshot cost**: the time per step (the whole run after warm-up, divided by its steps: a snapshot every k
  steps shows in the mean, not in the median) with ``Snapshot()`` (the default: ``"auto"``, at most 5 % of the
  run) and with ``Snapshot(every_n_train_steps=1)``, against without (runs alternated, the median over
  ``--reps``), the cadence "auto" chose, and the time rank 0 spends in a snapshot call, for the main job
  (examples/train_digits.py's model, data, batch size and checkpointing), a larger MLP (``--large-hidden``,
  Adam: the snapshot holds weights and two moments, ~30 MB per rank, copied while the next step computes) and a
  GPT-style LM. ``--busy N`` keeps N other processes spinning meanwhile (another job on the node: every core
  busy), which is where a background copy must never starve the step;
* **signal to exit**: SIGTERM to the launching process (or to rank 1) after step 5, until the launcher
  has exited with code 75 and the checkpoint is complete;
* **restart to first step**: SIGKILL of rank 1 after step 5 under ``max_restarts=1`` with snapshots,
  until the restarted attempt finishes its first step.
"""

from __future__ import annotations

import argparse
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
PARAMS: dict[int, int] = {}  # parameters of each case's model, as its job reported them

JOB = textwrap.dedent('''
    import json, os, sys, time, torch, phalanx
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    hidden, steps, restarts = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
    snapshot = sys.argv[3] if sys.argv[3] == "auto" else int(sys.argv[3])
    EXAMPLES, devices = sys.argv[5], int(sys.argv[6])

    class Clock:
        """Rank 0 appends (attempt, step, time) after each optimizer step, before the other callbacks run."""
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            with open(f"pid{trainer.global_rank}", "w") as fh:
                fh.write(str(os.getpid()))
            if trainer.global_rank == 0 and not os.path.exists("params"):
                with open("params", "w") as fh:
                    fh.write(str(sum(p.numel() for p in module.parameters())))
            if trainer.global_rank == 0:
                with open("clock.jsonl", "a") as fh:
                    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                    fh.write(json.dumps([attempt, trainer.global_step, time.time()]) + "\\n")

    class LM(phalanx.Module):  # a small GPT-style language model: 8 sequences of 128 tokens per rank and step
        def __init__(self, width):
            super().__init__()
            self.embed, self.pos = nn.Embedding(1024, width), nn.Parameter(torch.zeros(128, width))
            layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = nn.Linear(width, 1024)
        def training_step(self, batch, batch_idx):
            tokens = batch[0]
            mask = nn.Transformer.generate_square_subsequent_mask(127)
            h = self.blocks(self.embed(tokens[:, :-1]) + self.pos[:127], mask=mask, is_causal=True)
            return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens[:, 1:].flatten())
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    class MLP(phalanx.Module):  # the larger model
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                     nn.Linear(hidden, 10))
        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class TimedSnapshot(phalanx.callbacks.Snapshot):
        """Records how long each snapshot call takes on this rank (the direct cost, free of run-to-run noise)
        and the cadence in effect at the end."""
        took = []
        def on_train_batch_end(self, trainer, *args):
            start = time.perf_counter()
            before = self.cadence._taken
            super().on_train_batch_end(trainer, *args)
            if self.cadence._taken != before:  # a snapshot was written
                self.took.append(time.perf_counter() - start)
            if trainer.global_step == steps:
                with open(f"snapshot{trainer.global_rank}.json", "w") as fh:
                    json.dump({"took": self.took[3:], "every": self.every_n_train_steps}, fh)

    torch.manual_seed(0)
    callbacks = [Clock()] + ([TimedSnapshot(every_n_train_steps=snapshot)] if snapshot else [])
    if hidden == 0:  # the main job: examples/train_digits.py's model, data, batch size and checkpointing
        sys.path.insert(0, EXAMPLES)
        from train_digits import DigitsClassifier, digits_datasets
        phalanx.seed_everything(42, verbose=False)
        train_set, val_set = digits_datasets()
        model = DigitsClassifier(epochs=1000)
        loaders = (DataLoader(train_set, batch_size=32, shuffle=True), DataLoader(val_set, batch_size=128))
        callbacks.append(phalanx.callbacks.ModelCheckpoint(dirpath="ckpts", monitor="val_acc", mode="max",
                                                           save_last=True))
    elif hidden < 0:
        data = TensorDataset(torch.randint(0, 1024, (2048, 128)))
        model, loaders = LM(-hidden), (DataLoader(data, batch_size=8, shuffle=True), None)
    else:
        data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
        model, loaders = MLP(), (DataLoader(data, batch_size=32, shuffle=True), None)
    trainer = phalanx.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                              max_steps=steps, logger=False,
                              enable_progress_bar=False, enable_model_summary=False,
                              enable_checkpointing=hidden == 0, callbacks=callbacks, max_restarts=restarts,
                              default_root_dir="run")
    trainer.fit(model, *loaders)
''')


DEVICES = [2]  # ranks per job (--devices)


def _start(folder: Path, hidden: int, steps: int, snapshot: int | str, restarts: int) -> subprocess.Popen[bytes]:
    (folder / "job.py").write_text(JOB)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PHALANX_SHOW_TRACEBACKS": "0"}
    return subprocess.Popen([sys.executable, "job.py", str(hidden), str(steps), str(snapshot), str(restarts),
                             str(REPO / "examples"), str(DEVICES[0])],
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


def step_time(hidden: int, steps: int, snapshot: int | str) -> tuple[float, float, int]:
    """The time per step after warm-up (the run's time over its steps: every snapshot counts, and so does every
    validation pass, alike in each variant), the median time rank 0 spent in a snapshot call (0 without), and
    the cadence in effect at the end (0 without)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        proc = _start(folder, hidden, steps, snapshot, 0)
        if proc.wait(timeout=900) != 0:
            raise RuntimeError(proc.stderr.read().decode()[-2000:] if proc.stderr else "failed")
        times = [t for _, _, t in _clock(folder)][5:]  # after warm-up
        PARAMS[hidden] = int((folder / "params").read_text())
        report = json.loads((folder / "snapshot0.json").read_text()) if snapshot else {"took": [0.0], "every": 0}
        per_step = (times[-1] - times[0]) / (len(times) - 1)
        return per_step, statistics.median(report["took"] or [0.0]), int(report["every"] or 0)


class Busy:
    """``n`` processes spinning on a core each while the block runs: every core busy, as with another job."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []  # type: ignore[var-annotated]

    def __enter__(self) -> Busy:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                      for _ in range(self.n)]
        return self

    def __exit__(self, *_: object) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


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
        written = folder / ("ckpts" if hidden == 0 else "run/checkpoints") / "last.ckpt"
        if code != 75 or not written.exists():
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
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--large-hidden", type=int, default=1536)
    p.add_argument("--reps", type=int, default=3, help="runs of each case, alternated; medians are reported")
    p.add_argument("--only-snapshots", action="store_true", help="skip the signal and restart timings")
    p.add_argument("--cases", default="main,mlp,lm", help="which models, comma-separated (main, mlp, lm)")
    p.add_argument("--devices", type=int, default=2, help="ranks per job (1: one process, no DDP)")
    p.add_argument("--busy", type=int, default=0, help="other processes spinning meanwhile (one per core: busy)")
    args = p.parse_args()
    DEVICES[0] = args.devices
    cases = {"main": ("main job (examples/train_digits.py)", 0),
             "mlp": (f"larger MLP (64-{args.large_hidden}-{args.large_hidden}-10, Adam, batch 32)", args.large_hidden),
             "lm": ("GPT-style LM (4 layers, width 256, AdamW, 8 x 128 tokens)", -256)}
    sizes = dict(cases[c.strip()] for c in args.cases.split(","))
    ranks = f"{args.devices} ranks (DDP, gloo)" if args.devices > 1 else "1 process"
    busy = f", {args.busy} other processes spinning" if args.busy else ""
    print(f"torch {__import__('torch').__version__}, {os.cpu_count()} CPU cores, {ranks}{busy}, median of "
          f"{args.reps} alternated runs\n")
    print("| model | params | step (ms) | Snapshot() (ms) | its cost | cadence chosen | Snapshot(1) (ms) | its cost "
          "| snapshot call (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with Busy(args.busy):
        for name, hidden in sizes.items():
            plain, auto, every, spent, chosen = [], [], [], [], []
            steps = args.steps if hidden >= 0 else max(40, args.steps // 5)  # the LM's step is ~50x longer
            for _ in range(args.reps):
                plain.append(step_time(hidden, steps, 0)[0])
                step, _, k = step_time(hidden, steps, "auto")
                auto.append(step)
                chosen.append(k)
                step, call, _ = step_time(hidden, steps, 1)
                every.append(step)
                spent.append(call)
            p0, pa, p1 = statistics.median(plain), statistics.median(auto), statistics.median(every)
            c, params = statistics.median(spent), PARAMS[hidden]
            print(f"| {name} | {params / 1e6:.2f} M | {p0 * 1e3:.2f} | {pa * 1e3:.2f} | {(pa / p0 - 1) * 100:+.1f} % | "
                  f"{'/'.join(map(str, chosen))} | {p1 * 1e3:.2f} | {(p1 / p0 - 1) * 100:+.1f} % | {c * 1e3:.3f} |")
    if args.only_snapshots:
        return
    print("\n| event | model | seconds |")
    print("| --- | --- | ---: |")
    for name, hidden in list(sizes.items())[:2]:
        for target, who in (("launcher", "the launcher"), ("rank", "rank 1")):
            took = signal_to_exit(hidden, target)
            print(f"| SIGTERM to {who} -> exit 75, checkpoint written | {name} | {took:.2f} |")
        print(f"| kill -9 of rank 1 -> first step of the restarted attempt | {name} | "
              f"{restart_to_first_step(hidden):.2f} |")


if __name__ == "__main__":
    main()
