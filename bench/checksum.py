"""What checkpoint checksums cost: save and load of one state dict with and without them.

    python bench/checksum.py [--mb 200] [--reps 5] [--dir /tmp]

The state: ``--mb`` MiB of float32 tensors shaped like a model's (square Linear weights with biases).
Contenders, interleaved per repetition, each timed alone (medians; ratio = median of paired ratios):

* single file, save: phalanx's atomic ``torch.save`` (temporary file, fsync, rename) of the state plus
  phalanx's metadata, without checksums vs with them (``checksums.of_state`` before the write).
* single file, load: ``read_file`` of a file without checksums (nothing to verify) vs with them (every
  tensor hashed again after ``torch.load``). The file was just written, so it is read from the page
  cache: the worst case for the ratio, since a cold read from disk costs more and checksums nothing more.
* directory: a ``torch.distributed.checkpoint`` save of the same state (one process), then the checksums
  of its shard files (``of_files``, what a sharded save adds) and their verification (``check_files``,
  what a sharded load adds), next to the DCP save and load themselves.

Checksums are zlib's CRC-32 (the GIL is released; tensors are hashed on up to 4 threads).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint import checksums, storage
from phalanx.checkpoint.format import META_KEY, read_file


def make_state(mb: float) -> dict[str, Any]:
    torch.manual_seed(0)
    width = 1024
    layers = max(1, round(mb * 2**20 / (4 * (width * width + width))))
    model = {}
    for i in range(layers):
        model[f"layers.{i}.weight"] = torch.randn(width, width)
        model[f"layers.{i}.bias"] = torch.randn(width)
    return {"model": model, "step": 1000, "epoch": 3}


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="state dict size in MiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temporary directory)")
    args = parser.parse_args(argv)

    state = make_state(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    root = Path(tempfile.mkdtemp(prefix="phalanx-checksum-bench-", dir=args.dir))
    plain_file, checked_file, shards = root / "plain.pt", root / "checked.pt", root / "shards"

    def save_plain() -> None:
        storage.write_file({**state, META_KEY: {"format_version": 2, "layout": "file"}}, plain_file)

    def save_checked() -> None:
        record = checksums.of_state(state, "file")
        meta = {"format_version": 3, "layout": "file", "checksums": record}
        storage.write_file({**state, META_KEY: meta}, checked_file)

    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")

    def dcp_write() -> None:
        shutil.rmtree(shards, ignore_errors=True)
        dcp_save({"model": state["model"]}, storage_writer=FileSystemWriter(str(shards)))

    def dcp_read() -> None:
        template = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
        dcp_load(template, storage_reader=FileSystemReader(str(shards)))

    record: dict[str, Any] = {}

    def files_record() -> None:
        record.update(checksums.of_files(shards))

    def files_check() -> None:
        assert not checksums.check_files(shards, record)

    rows = [
        ("single file: save", save_plain, save_checked),
        ("single file: load", lambda: read_file(plain_file), lambda: read_file(checked_file)),
        ("directory: save (DCP) / + checksums of the shards", dcp_write, files_record),
        ("directory: load (DCP) / + verification of the shards", dcp_read, files_check),
    ]
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _, _ in rows}
    try:
        save_plain()
        save_checked()
        dcp_write()
        files_record()
        for rep in range(args.reps):
            for name, base, extra in rows:
                first, second = (base, extra) if rep % 2 == 0 or name.startswith("directory") else (extra, base)
                a, b = timed(first), timed(second)
                if first is extra:
                    a, b = b, a
                times[name][0].append(a)
                times[name][1].append(b)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"state: {nbytes / 2**20:.0f} MiB in {len(state['model'])} tensors; {args.reps} repetitions; "
          f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; medians")
    print()
    print("| what | without checksums (s) | with checksums (s) | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name, _, _ in rows:
        base, extra = times[name]
        if name.startswith("directory"):  # the checksum pass is extra work on top of DCP's own
            total = [a + b for a, b in zip(base, extra)]
            ratio = statistics.median(t / a for t, a in zip(total, base))
            print(f"| {name} | {statistics.median(base):.3f} | {statistics.median(total):.3f} | {ratio:.2f}x |")
        else:
            ratio = statistics.median(b / a for a, b in zip(base, extra))
            print(f"| {name} | {statistics.median(base):.3f} | {statistics.median(extra):.3f} | {ratio:.2f}x |")
    crc = statistics.median(timed(lambda: checksums.of_state(state, "file")) for _ in range(args.reps))
    print()
    print(f"checksums alone: {crc:.3f} s for {nbytes / 2**20:.0f} MiB ({nbytes / crc / 2**30:.2f} GiB/s)")


if __name__ == "__main__":
    main()
