"""``phalanx consolidate <sharded_dir> <out_file>``: one file from a sharded checkpoint.

Runs in a single plain process (no process group, no GPU): it reads every shard and writes the
single-file layout, which ``torch.load`` reads and any phalanx strategy loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from phalanx.utils.errors import CheckpointError


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "consolidate",
        help="turn a sharded (FSDP) checkpoint directory into one file that torch.load reads",
        description="Read every shard of SHARDED_DIR and write one torch.save file OUT_FILE (atomically).",
    )
    p.add_argument("sharded_dir", help="checkpoint directory written by fabric.save under strategy='fsdp'")
    p.add_argument("out_file", help="file to write")
    p.set_defaults(func=_cmd_consolidate)


def _describe(sd: dict[str, Any]) -> str:
    parts = []
    for key, value in sd.items():
        if key.startswith("__"):
            continue
        parts.append(f"{key} ({len(value)} entries)" if isinstance(value, dict) else key)
    return ", ".join(parts)


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from phalanx.checkpoint.layer import consolidate

    src, dst = Path(args.sharded_dir), Path(args.out_file)
    if src.resolve() == dst.resolve():
        print("phalanx consolidate: OUT_FILE must differ from SHARDED_DIR", file=sys.stderr)
        return 2
    try:
        sd = consolidate(src, dst)
    except CheckpointError as err:
        print(f"phalanx consolidate: {err}", file=sys.stderr)
        return 1
    print(f"wrote {dst} ({dst.stat().st_size / 2**20:.1f} MiB): {_describe(sd)}")
    return 0
