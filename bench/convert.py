"""Checkpoint conversion: time and peak memory of ``phalanx ckpt convert`` (and ``phalanx consolidate``, the
same code path) vs torch's own converters, and peak memory against the checkpoint's size.

    python bench/convert.py [--mb 256] [--reps 3] [--optimizer] [--quick] [--out table.md]

Data: a stack of square float32 Linear layers (``--mb`` MiB of weights; with ``--optimizer`` AdamW's
two state tensors per parameter too, after one step), saved once with phalanx's own single-process
``fabric.save`` (a single file) and converted once to a sharded directory; every contender then reads
those same files. Contenders, each in a fresh subprocess (interleaved per repetition, order alternated):

* single -> sharded: ``phalanx ckpt convert --to sharded`` vs
  ``torch.distributed.checkpoint.format_utils.torch_save_to_dcp``.
* sharded -> single: ``phalanx ckpt convert --to single`` and ``phalanx consolidate`` (which is that command)
  vs ``format_utils.dcp_to_torch_save``.
* single -> safetensors: ``phalanx ckpt convert --to safetensors`` vs ``torch.load`` +
  ``safetensors.torch.save_file`` (the usual two lines).
* sharded -> safetensors: ``phalanx ckpt convert --to safetensors`` vs ``dcp_to_torch_save`` + ``torch.load`` +
  ``save_file``.

Peak memory: the subprocess's ``ru_maxrss`` (from ``os.wait4``), its peak resident set size, which counts
the pages of memory-mapped files it touched (clean page cache the kernel can drop) as well as its own
allocations; and its peak anonymous memory (``RssAnon`` in ``/proc/<pid>/status``, sampled every 10 ms),
the allocations alone. Subprocesses that only import torch (and phalanx's converter) are measured too:
the floor every contender pays. The last column is what a contender allocated beyond its floor (phalanx's for
phalanx, torch's for torch's) as a share of the checkpoint's size: near 0 for a streaming converter, 1 or more
for one that holds the whole checkpoint. Output files are deleted after each run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
SRC = BENCH_DIR.parent / "src"

MAKE = """
import sys, torch
from torch import nn
from phalanx import Fabric
mb, with_opt, out = float(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
width = 2048
layers = max(1, round(mb * 2**20 / (width * width * 4)))
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
fabric = Fabric(accelerator="cpu", devices=1)
state = {"model": model, "step": 1}
if with_opt:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    state["optimizer"] = opt
fabric.save(out, state)
print(layers)
"""

PHALANX = "import sys; from phalanx.cli.commands import main; sys.exit(main(sys.argv[1:]))"
_FORMAT_UTILS = "import sys; from torch.distributed.checkpoint.format_utils import {} as f; f(*sys.argv[1:])"
TORCH_TO_DCP = _FORMAT_UTILS.format("torch_save_to_dcp")
DCP_TO_TORCH = _FORMAT_UTILS.format("dcp_to_torch_save")
SAFETENSORS_FROM_FILE = textwrap.dedent("""
    import os, sys, torch
    from safetensors.torch import save_file
    os.makedirs(sys.argv[2])
    sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
    save_file(dict(sd["model"]), sys.argv[2] + "/model.safetensors")
""")
SAFETENSORS_FROM_DCP = textwrap.dedent("""
    import os, sys, torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from safetensors.torch import save_file
    os.makedirs(sys.argv[2])
    dcp_to_torch_save(sys.argv[1], sys.argv[2] + ".tmp.pt")
    sd = torch.load(sys.argv[2] + ".tmp.pt", map_location="cpu", weights_only=True)
    os.remove(sys.argv[2] + ".tmp.pt")
    save_file(dict(sd["model"]), sys.argv[2] + "/model.safetensors")
""")
FLOOR = "import torch"
FLOOR_PHALANX = "import torch, phalanx.cli.commands, phalanx.offline.convert"


def _anon_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run(code: str, *args: str) -> tuple[float, float, float]:
    """Seconds, peak RSS (MiB, ru_maxrss) and peak anonymous memory (MiB, RssAnon sampled every 10 ms) of
    ``python -c code args`` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    anon = 0.0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        anon = max(anon, _anon_mib(proc.pid))
        time.sleep(0.01)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{code[:60]!r} {args} failed ({proc.returncode}):\n{err[-3000:]}")
    return seconds, usage.ru_maxrss / 1024, anon  # ru_maxrss: KiB on Linux


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    tmp = path.with_name(path.name + ".tmp.pt")
    if tmp.exists():
        tmp.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=256, help="MiB of model weights (default 256)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--optimizer", action="store_true", help="add AdamW's state (3x the weights in all)")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 1 repetition: checks the script")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.reps = 16, 1
    work = Path(tempfile.mkdtemp(prefix="phalanx_convert_bench_"))
    try:
        single, sharded = work / "ckpt.pt", work / "ckpt_dcp"
        make = subprocess.run([sys.executable, "-c", MAKE, str(args.mb), "1" if args.optimizer else "0", str(single)],
                              env={**os.environ, "PYTHONPATH": str(SRC)}, check=True, capture_output=True, text=True)
        run(PHALANX, "ckpt", "convert", str(single), str(sharded), "--to", "sharded")
        size = single.stat().st_size / 2**20
        out = work / "out"
        def convert(src: Path, to: str) -> list[str]:  # phalanx takes SRC DST --to X; torch's helpers SRC DST
            return ["ckpt", "convert", str(src), str(out), "--to", to]

        cases = [
            ("single -> sharded", [("phalanx ckpt convert", PHALANX, convert(single, "sharded")),
                                   ("torch_save_to_dcp", TORCH_TO_DCP, [str(single), str(out)])]),
            ("sharded -> single", [("phalanx ckpt convert", PHALANX, convert(sharded, "single")),
                                   ("phalanx consolidate", PHALANX, ["consolidate", str(sharded), str(out)]),
                                   ("dcp_to_torch_save", DCP_TO_TORCH, [str(sharded), str(out)])]),
            ("single -> safetensors", [("phalanx ckpt convert", PHALANX, convert(single, "safetensors")),
                                       ("torch.load + save_file", SAFETENSORS_FROM_FILE, [str(single), str(out)])]),
            ("sharded -> safetensors", [("phalanx ckpt convert", PHALANX, convert(sharded, "safetensors")),
                                        ("dcp_to_torch_save + save_file", SAFETENSORS_FROM_DCP,
                                         [str(sharded), str(out)])]),
        ]
        results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        floor = [run(FLOOR) for _ in range(args.reps)]
        floor_phalanx = [run(FLOOR_PHALANX) for _ in range(args.reps)]
        for rep in range(args.reps):
            for case, contenders in cases:
                for name, code, argv in (contenders if rep % 2 == 0 else contenders[::-1]):
                    results.setdefault((case, name), []).append(run(code, *argv))
                    remove(out)

        def med(runs: list[tuple[float, float, float]], i: int) -> float:
            return statistics.median(r[i] for r in runs)

        lines = [
            f"checkpoint: {size:.0f} MiB single file ({make.stdout.strip()} Linear(2048, 2048) layers"
            f"{' + AdamW state' if args.optimizer else ''}); median of {args.reps} runs",
            "",
            "| conversion | contender | time (s) | peak RSS (MiB) | peak anonymous (MiB) | anonymous above floor / "
            "checkpoint size |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
            f"| (floor) | python + import torch | {med(floor, 0):.2f} | {med(floor, 1):.0f} | {med(floor, 2):.0f} | |",
            f"| (floor) | python + import phalanx's converter | {med(floor_phalanx, 0):.2f} | "
            f"{med(floor_phalanx, 1):.0f} | {med(floor_phalanx, 2):.0f} | |",
        ]
        for (case, name), runs in results.items():
            base = med(floor_phalanx if name.startswith("phalanx") else floor, 2)
            share = max(0.0, med(runs, 2) - base) / size
            lines.append(f"| {case} | {name} | {med(runs, 0):.2f} | {med(runs, 1):.0f} | {med(runs, 2):.0f} | "
                         f"{share:.2f} |")
        table = "\n".join(lines)
        print(table)
        if args.out:
            Path(args.out).write_text(table + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
