"""2-rank DDP throughput on CPU (gloo): raw torch DDP under torchrun, phalanx Fabric under
`phalanx run` (default and strict lockstep), Lightning Fabric and Accelerate under torchrun.

    bash bench/setup.sh
    bench/.venv/bin/python bench/ddp.py [--reps 5 --steps 150]

Each repetition launches every contender once, in turn (interleaved), as a fresh 2-process job on
torch's own launcher, so process start-up is identical and excluded from the timing (only steps
after the warm-up are timed, by the model itself). phalanx's lockstep guard is always on; its cost
is the phalanx row's ratio to raw DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    BENCH_DIR,
    REPO,
    framework_versions,
    machine_line,
    median,
    paired_ratio,
    require_bench_venv,
    table,
)
from _ddp_worker import CONFIG

WORKER = BENCH_DIR / "_ddp_worker.py"
WORLD = 2


def launch_command(framework: str) -> list[str]:
    if framework == "phalanx":
        return [sys.executable, "-m", "phalanx.cli", "run", "--devices", str(WORLD), "--accelerator", "cpu"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD)]


# name -> (worker framework, extra environment)
CONTENDERS: dict[str, tuple[str, dict[str, str]]] = {
    "raw torch DDP (torchrun)": ("raw", {}),
    "phalanx Fabric (lockstep=default)": ("phalanx", {"PHALANX_LOCKSTEP": "default"}),
    "phalanx Fabric (lockstep=strict)": ("phalanx", {"PHALANX_LOCKSTEP": "strict"}),
    "Lightning Fabric": ("lightning", {}),
    "Accelerate": ("accelerate", {}),
}


def run_once(framework: str, extra_env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        *launch_command(framework), str(WORKER), "--framework", framework, "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--batch", str(args.batch), "--threads", str(args.threads),
    ]
    # One intra-op thread per rank on every launcher (torchrun and `phalanx run` pick their own
    # defaults otherwise, and they differ).
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1", **extra_env}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_RESULT ")]
    if proc.returncode != 0 or len(lines) != 1:
        raise RuntimeError(
            f"{' '.join(cmd)} exited with {proc.returncode} and {len(lines)} result line(s):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    result: dict[str, Any] = json.loads(lines[0].removeprefix("BENCH_RESULT "))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150, help="steps per job")
    parser.add_argument("--warmup", type=int, default=20, help="leading steps left out of the timing")
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one job may take")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    require_bench_venv(["lightning", "accelerate", "phalanx"])

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    for rep in range(args.reps):
        # A B C, then C B A: no contender always runs right after the same neighbour.
        order = list(CONTENDERS.items()) if rep % 2 == 0 else list(reversed(CONTENDERS.items()))
        for name, (framework, extra_env) in order:
            results[name].append(run_once(framework, extra_env, args))
        print(f"  rep {rep + 1}/{args.reps}: " + ", ".join(
            f"{n.split(' (')[0]} {r[-1]['median_step_s'] * 1e3:.2f}" for n, r in results.items()
        ) + " ms/step", file=sys.stderr, flush=True)

    raw_name = next(iter(CONTENDERS))
    raw_median = [r["median_step_s"] for r in results[raw_name]]
    raw_mean = [r["mean_step_s"] for r in results[raw_name]]
    raw_cpu = [r["cpu_step_s"] for r in results[raw_name]]
    ref_loss = results[raw_name][0]["loss"]
    rows = []
    for name, runs in results.items():
        med = [r["median_step_s"] for r in runs]
        mean = [r["mean_step_s"] for r in runs]
        cpu = [r["cpu_step_s"] for r in runs]
        global_batch = runs[0]["global_batch"]
        losses = {r["loss"] for r in runs}
        if len(losses) != 1:
            raise RuntimeError(f"{name} is not deterministic across repetitions: final losses {sorted(losses)}.")
        loss = runs[0]["loss"]
        rows.append([
            name,
            f"{global_batch / median(med):.0f}",
            # Throughput ratio = inverse of the step-time ratio.
            f"{1 / paired_ratio(med, raw_median):.4f}",
            f"{1 / paired_ratio(mean, raw_mean):.4f}",
            f"{median(cpu) * 1e3:.2f}",
            f"{paired_ratio(cpu, raw_cpu):.4f}",
            f"{loss:.10f} (diff {abs(loss - ref_loss):.1e})",
        ])
    print(f"## DDP throughput, {WORLD} CPU ranks, gloo ({machine_line()})")
    print(f"MLP {CONFIG}, per-rank batch {args.batch}, AdamW, {args.threads} thread(s) per rank; "
          f"{args.steps} steps ({args.warmup} warm-up) per job x {args.reps} interleaved repetitions.")
    print(f"versions: {framework_versions()}")
    print(table(
        ["contender", "samples/s (median step)", "x raw (median step)", "x raw (mean step)",
         "rank-0 CPU ms/step", "CPU x raw", "final loss"], rows
    ))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))

if __name__ == "__main__":
    main()
