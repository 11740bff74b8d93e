"""The checkpoint commands: ``phalanx ckpt inspect PATH`` and ``phalanx ckpt convert SRC DST --to ...``
(see docs/checkpoints.md), and ``phalanx consolidate <sharded_dir> <out_file>``: Lightning's ``fabric
consolidate`` under phalanx's name, for ported scripts (what ``phalanx ckpt convert --to single`` does for a
sharded directory).

All run in one plain process (no process group, no GPU). Exit codes: 0 done, 1 the checkpoint cannot be
read or written, or is corrupt (the reason on one line, naming the damaged tensor), 2 bad arguments
(argparse's own errors too).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from phalanx.utils.errors import CheckpointError


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "consolidate",
        help="turn a sharded checkpoint directory into one file that torch.load reads",
        description="Read SHARDED_DIR shard by shard and write one torch.save file OUT_FILE (atomically, with "
                    "checksums; it must not exist): what `phalanx ckpt convert SHARDED_DIR OUT_FILE --to single` does.",
    )
    p.add_argument("sharded_dir", help="checkpoint directory (fabric.save under strategy='fsdp' or 'deepspeed', or a "
                                       "plain torch.distributed.checkpoint directory)")
    p.add_argument("out_file", help="file to write (must not exist)")
    p.set_defaults(func=_cmd_consolidate)
    _add_ckpt(sub)


def _add_ckpt(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ckpt = sub.add_parser("ckpt", help="inspect or convert a checkpoint (single file, sharded, DeepSpeed)",
                          description="Inspect or convert any phalanx checkpoint in one plain process.")
    cmds = ckpt.add_subparsers(dest="ckpt_command", required=True)
    trust = ("the checkpoint comes from a trusted source: allow unpickling objects other than tensors and plain "
             "values, which can run code (phalanx's own checkpoints never need it)")
    p = cmds.add_parser("inspect", help="verify a checkpoint; what it holds and what can load it",
                        description="Verify PATH against the checksums it recorded (exit code 1 and the damaged "
                                    "tensor named if it is corrupt), then show its strategy, world size, step/epoch, "
                                    "entries, tensors and sizes, and what can load it.")
    p.add_argument("path", help="checkpoint file or directory")
    p.add_argument("--all", action="store_true", help="list every tensor (default: the largest --top)")
    p.add_argument("--top", type=int, default=10, help="how many of the largest tensors to list (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object (every tensor) for scripts")
    p.add_argument("--no-verify", action="store_true",
                   help="skip verifying the checksums (which reads every byte once); read metadata only")
    p.add_argument("--trust", action="store_true", help=trust)
    p.set_defaults(func=_cmd_inspect)
    p = cmds.add_parser(
        "convert", help="convert between single file, sharded (DCP) directory and safetensors",
        description="Convert SRC (single file, sharded DCP directory or DeepSpeed directory) to DST: --to single (one "
                    "torch.load-able file), sharded (a DCP directory fabric.load reads at any world size) or "
                    "safetensors (DST/model.safetensors with one module's weights, for from_pretrained).")
    p.add_argument("src", help="checkpoint to read")
    p.add_argument("dst", help="file or directory to create (must not exist)")
    p.add_argument("--to", required=True, choices=["single", "sharded", "safetensors"], help="target layout")
    p.add_argument("--entry", default=None, help="safetensors: the module entry to export (default: the only one)")
    p.add_argument("--prefix", default=None,
                   help="safetensors: strip exactly this prefix from the weight names ('' keeps them). Default: "
                        "wrapper prefixes (_orig_mod., _forward_module., module.) and a 'model.' every key shares")
    p.add_argument("--config", default=None, help="safetensors: a config.json to copy next to the weights")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--trust", action="store_true", help=trust)
    p.set_defaults(func=_cmd_convert)


def _fail(command: str, err: Exception, code: int = 1) -> int:
    name = "phalanx consolidate" if command == "consolidate" else f"phalanx ckpt {command}"
    print(f"{name}: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
    return code


def _cmd_inspect(args: argparse.Namespace) -> int:
    from phalanx.offline.summary import describe, render

    if not Path(args.path).exists() and not Path(args.path).is_symlink():
        return _fail("inspect", FileNotFoundError(f"no such file or directory: {args.path}"), 2)
    if args.top < 0:
        return _fail("inspect", ValueError("--top must be >= 0"), 2)
    try:
        info = describe(args.path, weights_only=not args.trust, verify=not args.no_verify)
    except CheckpointError as err:
        return _fail("inspect", err)
    print(json.dumps(info, indent=1) if args.json else render(info, None if args.all else args.top))
    return 0


def _cmd_convert(args: argparse.Namespace, command: str = "convert") -> int:
    from phalanx.offline.convert import convert
    from phalanx.offline.summary import human

    src, dst = Path(args.src), Path(args.dst)
    if not src.exists() and not src.is_symlink():
        return _fail(command, FileNotFoundError(f"no such file or directory: {src}"), 2)
    if dst.exists() or dst.is_symlink():
        return _fail(command, FileExistsError(f"{dst} exists; convert never overwrites: remove it or choose "
                                              "another DST"), 2)
    if args.to != "safetensors" and (args.entry or args.prefix is not None or args.config):
        return _fail(command, ValueError("--entry, --prefix and --config apply to --to safetensors only"), 2)
    try:
        out = convert(src, dst, args.to, weights_only=not args.trust, entry=args.entry, prefix=args.prefix,
                      config=args.config)
    except CheckpointError as err:
        return _fail(command, err)
    if args.json:
        print(json.dumps(out))
        return 0
    what = (f"{out['entry']!r} ({out['tensors']} tensors; stripped {', '.join(out['stripped']) or 'no prefix'})"
            if args.to == "safetensors" else ", ".join(out["entries"]))
    print(f"wrote {dst} ({args.to}, {human(out['bytes'])}) from {out['source_kind']} {src}: {what}")
    for note in out["notes"]:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _cmd_consolidate(args: argparse.Namespace) -> int:
    """``phalanx ckpt convert SHARDED_DIR OUT_FILE --to single`` (one code path), for a directory only, as
    Lightning's ``fabric consolidate`` takes one."""
    if Path(args.sharded_dir).is_file():
        return _fail("consolidate", CheckpointError(f"{args.sharded_dir} is a file, not a sharded checkpoint "
                                                    "directory."))
    single = argparse.Namespace(src=args.sharded_dir, dst=args.out_file, to="single", entry=None, prefix=None,
                                config=None, json=False, trust=False)
    return _cmd_convert(single, "consolidate")
