"""The ``phalanx`` command line.

``phalanx run [options] script.py [args...]`` starts a job with ``torch.distributed.run`` (torchrun's
engine: rendezvous, multi-node, failure handling) and passes ``--strategy``/``--precision``/... to the
script's ``Fabric``/``Trainer`` through environment variables.

``phalanx fit|validate|test|predict --config cfg.yaml [--trainer.x=...]`` trains from a config (see
:mod:`phalanx.cli.config`, Lightning's LightningCLI). ``LightningCLI`` is importable from here too.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from phalanx.cli import ckpt
from phalanx.precision import PRECISIONS


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run",
        help="run a training script on N processes (one or many nodes)",
        description="Run SCRIPT in --devices processes per node on --num-nodes nodes, on torch.distributed.run.",
    )
    p.add_argument("--accelerator", default=None, choices=["auto", "cpu", "cuda", "gpu"],
                   help="overrides the script's accelerator (default: the script's own)")
    p.add_argument("--devices", type=int, default=1, help="processes per node (default 1)")
    p.add_argument("--num-nodes", type=int, default=1,
                   help="how many nodes the job spans; start `phalanx run` once on each (default 1)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's rank among --num-nodes: 0 on the node at --main-address, then 1, 2, ... "
                        "(default 0)")
    p.add_argument("--main-address", default="127.0.0.1", help="address of the node with rank 0")
    p.add_argument("--main-port", type=int, default=None, help="port on the main node (default: free port)")
    p.add_argument("--strategy", default=None, help="overrides the script's strategy")
    p.add_argument("--precision", default=None, choices=list(PRECISIONS), help="overrides the script's precision")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the job's processes up to this many times after one fails; a Trainer resumes "
                        "from its newest checkpoint (default 0)")
    p.add_argument("--show-tracebacks", action="store_true",
                   help="print every rank's stderr (tracebacks included) here, as torchrun does, instead of "
                        "writing it to $PHALANX_LOG_DIR (default ./phalanx_logs) and showing it without "
                        "tracebacks (also PHALANX_SHOW_TRACEBACKS=1)")
    p.add_argument("--replica-groups", type=int, default=None, metavar="N",
                   help="run N fault-tolerant replica groups of --devices processes each (torchft: pip install "
                        "'phalanx[ft]'); a group that dies restarts alone (--max-restarts) and heals from a live one")
    p.add_argument("--min-replica-groups", type=int, default=1, metavar="K",
                   help="with --replica-groups: a step commits only when at least K groups took part (default 1)")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if args.devices < 1 or args.num_nodes < 1 or args.max_restarts < 0:
        print("phalanx run: --devices and --num-nodes must be >= 1, --max-restarts >= 0", file=sys.stderr)
        return 2
    if not os.path.isfile(args.script):
        print(f"phalanx run: no such script: {args.script}", file=sys.stderr)
        return 2
    if args.replica_groups is not None:
        return _run_replica_groups(args)
    env = {
        "PHALANX_DEVICES": str(args.devices),
        "PHALANX_NUM_NODES": str(args.num_nodes),
        "PHALANX_ACCELERATOR": args.accelerator,
        "PHALANX_STRATEGY": args.strategy,
        "PHALANX_PRECISION": args.precision,
    }
    os.environ.update({k: v for k, v in env.items() if v is not None})
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.devices)))
    torchrun = ["--nproc-per-node", str(args.devices), "--nnodes", str(args.num_nodes),
                "--max-restarts", str(args.max_restarts)]
    if args.num_nodes == 1 and args.main_port is None:
        torchrun += ["--standalone"]
    else:
        torchrun += [
            "--node-rank", str(args.node_rank),
            "--master-addr", args.main_address,
            "--master-port", str(args.main_port or 29500),
        ]
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from phalanx.distributed.failures import NotRestarted
    from phalanx.distributed.launch import AGENT_SIGNALS, new_run_id, prepare_agent_process
    from phalanx.distributed.runlogs import RunLogs

    prepare_agent_process()
    # The ranks' stderr goes to a log file (torch's --redirects), shown here without tracebacks; a failure
    # ends with the log's path and the cause (see phalanx.distributed.runlogs). The log folder is under the
    # working directory: this process starts before the script says where its root is.
    # On several nodes each launcher sees its own ranks only, numbered globally: it names the failed ones alone.
    logs = RunLogs(new_run_id(), show=True if args.show_tracebacks else None,
                   ranks=args.devices if args.num_nodes == 1 else None, first_rank=args.node_rank * args.devices,
                   max_restarts=args.max_restarts)
    torchrun += logs.torchrun_args()
    if any("--signals-to-handle" in action.option_strings for action in get_args_parser()._actions):
        torchrun += ["--signals-to-handle", AGENT_SIGNALS]
    script_args = [a for a in args.script_args if a != "--"] if args.script_args[:1] == ["--"] else args.script_args
    parsed = get_args_parser().parse_args([*torchrun, args.script, *script_args])
    try:
        with logs:
            run(parsed)
    except (ChildFailedError, NotRestarted) as err:
        return logs.report_failure(err, see_above="See the failing rank's output above.")
    except SignalException as err:  # passed on to the ranks, which saved and said so (a preemption)
        return logs.report_signal(err.sigval)
    return 0


def _run_replica_groups(args: argparse.Namespace) -> int:
    """``--replica-groups N``: the lighthouse and one ``phalanx run`` per group (phalanx.distributed.replica_launch)."""
    from phalanx.distributed.replica_launch import run_groups
    from phalanx.utils.errors import MisconfigurationError

    if args.num_nodes != 1:
        print("phalanx run: --replica-groups runs every group on this machine; on several machines start one "
              "`phalanx run` (or torchrun) per group with the variables of docs/faults.md.", file=sys.stderr)
        return 2
    passed = [flag for name, flag in (("accelerator", "--accelerator"), ("strategy", "--strategy"),
                                      ("precision", "--precision")) for value in [getattr(args, name)] if value]
    extra = [arg for flag in passed for arg in (flag, getattr(args, flag[2:]))]
    extra += ["--show-tracebacks"] if args.show_tracebacks else []
    script_args = [a for a in args.script_args if a != "--"] if args.script_args[:1] == ["--"] else args.script_args
    try:
        return run_groups(args.replica_groups, args.devices, args.max_restarts, args.min_replica_groups,
                          args.script, list(script_args), extra)
    except MisconfigurationError as err:
        print(f"phalanx run: {err}", file=sys.stderr)
        return 2


def _add_config_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Listed for `phalanx --help`; main() hands these commands to jsonargparse before argparse sees them.
    for name in ("fit", "validate", "test", "predict"):
        sub.add_parser(name, help=f"trainer.{name}() from a YAML config (phalanx {name} --help for its options)",
                       add_help=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx", description="phalanx: scale PyTorch training correctly.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_config_commands(sub)
    ckpt.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("fit", "validate", "test", "predict"):
        from phalanx.cli.config import main as config_main

        return config_main(argv)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
