"""Wall time of ``import phalanx`` next to ``import torch``, ``import lightning`` and
``import accelerate``, each in a fresh interpreter, interleaved, several runs, medians.

    bash bench/setup.sh
    bench/.venv/bin/python bench/import_time.py [--runs 9]

It also runs ``python -X importtime -c "import phalanx"`` and lists every module phalanx pulls in
that ``import torch`` does not, flagging the heavy optional ones that must stay lazy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    REPO,
    framework_versions,
    machine_line,
    median,
    paired_ratio,
    require_bench_venv,
    table,
)

STATEMENTS = {
    "python (no import)": "pass",
    "import torch": "import torch",
    "import phalanx": "import phalanx",
    "import lightning": "import lightning",
    "import accelerate": "import accelerate",
}
# Optional dependencies phalanx must import only when a feature needs them.
HEAVY = ("deepspeed", "tensorboard", "matplotlib", "rich", "lightning", "accelerate", "sklearn", "pandas", "scipy")


def wall_time(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True, cwd=REPO, env=_env())
    return time.perf_counter() - start


def _env() -> dict[str, str]:
    # No bytecode writes (first-run compile would bias whichever runs first) and no user site.
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}


def import_profile(statement: str) -> dict[str, tuple[int, int]]:
    """module -> (self us, cumulative us) from ``-X importtime`` (first import of each module)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement], cwd=REPO, env=_env(), capture_output=True,
        text=True, check=True,
    )
    out: dict[str, tuple[int, int]] = {}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, name = (part.strip() for part in line.removeprefix("import time:").split("|"))
        out.setdefault(name.strip(), (int(self_us), int(cum_us)))
    return out


def import_chain(statement: str, target: str) -> list[str]:
    """The chain of imports through which ``statement`` first reaches ``target`` (outermost first).

    ``-X importtime`` prints a module after everything it imported, indented by depth; the first
    line of the target is followed by its ancestors at decreasing depth.
    """
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement], cwd=REPO, env=_env(), capture_output=True,
        text=True, check=True,
    )
    lines = [raw.split("|")[2] for raw in proc.stderr.splitlines() if raw.startswith("import time:")][1:]
    start = next((i for i, raw in enumerate(lines) if raw.strip() == target), None)
    if start is None:
        return []
    chain = [target]
    depth = len(lines[start]) - len(lines[start].lstrip())
    for raw in lines[start + 1:]:
        d = len(raw) - len(raw.lstrip())
        if d < depth:
            chain.append(raw.strip())
            depth = d
    return chain[::-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9, help="fresh interpreters per statement")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    require_bench_venv(["lightning", "accelerate", "phalanx"])

    for statement in STATEMENTS.values():  # warm the page cache so run 1 is not a disk benchmark
        wall_time(statement)
    times: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    for _ in range(args.runs):
        for name, statement in STATEMENTS.items():
            times[name].append(wall_time(statement))

    bare = times["python (no import)"]
    torch_t = times["import torch"]
    rows = []
    for name, t in times.items():
        net = [a - b for a, b in zip(t, bare)]
        over_torch = "" if name == "python (no import)" else f"{paired_ratio(t, torch_t):.3f}"
        rows.append([name, f"{median(t) * 1e3:.0f}", f"{median(net) * 1e3:.0f}", over_torch])
    phalanx_extra = median([p - t for p, t in zip(times["import phalanx"], torch_t)])
    torch_net = median([t - b for t, b in zip(torch_t, bare)])

    print(f"## Import time ({machine_line()})")
    print(f"Fresh interpreter per run, {args.runs} interleaved runs, medians. versions: {framework_versions()}")
    print(table(["statement", "wall ms", "minus bare python, ms", "x import torch (paired)"], rows))
    print(f"phalanx adds {phalanx_extra * 1e3:.0f} ms to import torch "
          f"({100 * phalanx_extra / torch_net:.1f} % of torch's own import time).")

    torch_mods = import_profile("import torch")
    phalanx_mods = import_profile("import phalanx")
    extra = {m: v for m, v in phalanx_mods.items() if m not in torch_mods}
    heavy = sorted(m for m in extra if m.split(".")[0] in HEAVY)
    top = sorted(extra.items(), key=lambda kv: -kv[1][0])[:12]
    extra_ms = sum(s for s, _ in extra.values()) / 1e3
    torch_ms = torch_mods["torch"][1] / 1e3
    # Less noisy than wall time on a busy machine: the interpreter's own per-module clock.
    print(f"\n-X importtime: the {len(extra)} modules `import phalanx` loads beyond `import torch` take "
          f"{extra_ms:.0f} ms (self time), {100 * extra_ms / torch_ms:.1f} % of `import torch` ({torch_ms:.0f} ms). "
          "The slowest:")
    print(table(["module", "self ms", "cumulative ms"], [[m, f"{s / 1e3:.1f}", f"{c / 1e3:.1f}"] for m, (s, c) in top]))
    if heavy:
        roots = sorted({m.split(".")[0] for m in heavy})
        print(f"HEAVY optional imports loaded eagerly by `import phalanx`: {', '.join(roots)}")
        for root in roots:
            print(f"  {root}: " + " -> ".join(import_chain("import phalanx", root)))
    else:
        print(f"No heavy optional import ({', '.join(HEAVY)}) is loaded by `import phalanx`.")
    if args.json:
        args.json.write_text(json.dumps({"times": times, "extra_modules": sorted(extra), "heavy": heavy}, indent=1))


if __name__ == "__main__":
    main()
