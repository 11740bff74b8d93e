"""Run the CPU benchmarks (overhead, DDP, import time; lockstep.py and checkpoint.py when present) plus
bench/gpu.py (which prints a skip line without CUDA), and print one report.

    bash bench/setup.sh
    bench/.venv/bin/python bench/run_all.py [--quick] [--out report.md]

Each script runs in its own interpreter, one after another, so none disturbs another's timing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BENCH_DIR, REPO, framework_versions, git_revision, machine_line, require_bench_venv

# script -> extra arguments for --quick (a smoke run: the numbers are not meant to be quoted)
SCRIPTS = {
    "overhead.py": ["--reps", "2", "--steps", "60"],
    "ddp.py": ["--reps", "1", "--steps", "60"],
    "import_time.py": ["--runs", "2"],
    "lockstep.py": ["--rounds", "1", "--steps", "60", "--warmup", "10"],
    "checkpoint.py": [],
    "gpu.py": ["--reps", "1", "--steps", "5"],
    "startup.py": ["--reps", "1"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: checks the scripts, not speed")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args()
    require_bench_venv(["lightning", "accelerate", "phalanx"])
    sections = [
        "# phalanx benchmarks",
        f"{machine_line()} | revision {git_revision()} | {framework_versions()}",
    ]
    failed = []
    for script, quick_args in SCRIPTS.items():
        path = BENCH_DIR / script
        if not path.exists():
            sections.append(f"## {script}: not present in this checkout")
            continue
        cmd = [sys.executable, str(path), *(quick_args if args.quick else [])]
        print(f"running {' '.join(cmd[1:])} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        took = time.perf_counter() - start
        print(f"  done in {took:.0f} s (exit {proc.returncode})", file=sys.stderr, flush=True)
        if proc.returncode != 0:
            failed.append(script)
            sections.append(f"## {script}: FAILED (exit {proc.returncode})\n```\n{proc.stderr[-4000:]}\n```")
            continue
        sections.append(proc.stdout.strip())
    report = "\n\n".join(sections) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
    if failed:
        sys.exit(f"benchmark script(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
