"""Starting and joining multi-process jobs, on torch's own launcher.

* Under torchrun, ``phalanx run``, or SLURM, the processes already exist: :func:`detect_environment`
  reads who we are and :func:`check_environment` compares it with what the code asked for.
* Under plain ``python train.py`` with ``devices=N``, :func:`launch_script` re-runs the script in N
  processes and :func:`launch_function` runs a function in N processes. Both use
  ``torch.distributed.launcher.elastic_launch`` (the engine behind torchrun): the calling process
  becomes the agent that supervises the ranks, kills the survivors when one fails, and returns the
  failing rank's exit code. There is no home-made process management here.
* A failed job reads once: the ranks' stderr goes to a log file written by torch's agent, shown on the
  terminal without tracebacks, and the launcher ends with the log's path and the cause
  (:mod:`phalanx.distributed.runlogs`, :mod:`phalanx.distributed.failures`); a restarted attempt's rank 0
  says in one line what failed and where it resumed (:mod:`phalanx.distributed.restarts`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.distributed.failures import (
    RECORD_KEY,
    NotRestarted,
    failure_summary,
    preempted_summary,
    restart_record,
    signal_name,
)
from phalanx.distributed.preemption import EXIT_PREEMPTED, Preempted
from phalanx.distributed.runlogs import RunLogs, log_root
from phalanx.utils import exiting
from phalanx.utils.diagnostics import RELAUNCHED_VARIABLE, notice
from phalanx.utils.errors import MisconfigurationError, PhalanxError

# More CPU processes than this many per core are refused when phalanx starts them itself: each rank
# imports torch (hundreds of MB) and they thrash (64 ranks on 2 cores took 10.9 GB and died at start-up).
MAX_CPU_RANKS_PER_CORE = 4


@dataclass(frozen=True)
class ClusterEnvironment:
    """Who this process is inside an already-launched job."""

    source: str  # "torchelastic" (torchrun / phalanx run / phalanx launch) or "slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    agent_hosts_store: bool


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise MisconfigurationError(f"Environment variable {name} is required but not set.")
        return default
    try:
        return int(value)
    except ValueError:
        raise MisconfigurationError(f"Environment variable {name}={value!r} is not an integer.") from None


def _slurm_first_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as ``node[003-007,9],gpu1``."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return "127.0.0.1"
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_environment() -> ClusterEnvironment | None:
    """The launched job this process belongs to, or None when it runs on its own."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env:
        world = _env_int("WORLD_SIZE")
        local_world = _env_int("LOCAL_WORLD_SIZE", world)
        return ClusterEnvironment(
            source="torchelastic" if "TORCHELASTIC_RUN_ID" in env else "env",
            rank=_env_int("RANK"),
            world_size=world,
            local_rank=_env_int("LOCAL_RANK", 0),
            local_world_size=local_world,
            node_rank=_env_int("GROUP_RANK", _env_int("NODE_RANK", _env_int("RANK") // max(local_world, 1))),
            master_addr=env["MASTER_ADDR"],
            master_port=_env_int("MASTER_PORT"),
            agent_hosts_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        world = _env_int("SLURM_NTASKS")
        job_id = _env_int("SLURM_JOB_ID", 0)
        return ClusterEnvironment(
            source="slurm",
            rank=_env_int("SLURM_PROCID"),
            world_size=world,
            local_rank=_env_int("SLURM_LOCALID", 0),
            local_world_size=_env_int("SLURM_NTASKS_PER_NODE", world) if "SLURM_NTASKS_PER_NODE" in env
            and env["SLURM_NTASKS_PER_NODE"].isdigit() else world // max(_env_int("SLURM_NNODES", 1), 1),
            node_rank=_env_int("SLURM_NODEID", 0),
            master_addr=env.get("MASTER_ADDR") or _slurm_first_host(env.get("SLURM_NODELIST", "127.0.0.1")),
            master_port=_env_int("MASTER_PORT", 20000 + job_id % 20000),
            agent_hosts_store=False,
        )
    return None


def check_environment(env: ClusterEnvironment, devices: int, num_nodes: int) -> None:
    """Fail fast when the launched job does not match ``Fabric(devices=..., num_nodes=...)``."""
    expected = devices * num_nodes
    if env.world_size != expected or env.local_world_size != devices:
        how = {
            "slurm": f"submit with `--nodes={num_nodes} --ntasks-per-node={devices}`",
            "torchelastic": f"launch with `--nproc-per-node={devices} --nnodes={num_nodes}`",
            "env": f"set WORLD_SIZE={expected} and LOCAL_WORLD_SIZE={devices}",
        }[env.source]
        raise MisconfigurationError(
            f"The code asks for devices={devices}, num_nodes={num_nodes} ({expected} processes), but "
            f"{env.source} started {env.world_size} process(es) with {env.local_world_size} per node. "
            f"Either change devices/num_nodes to match, or {how}."
        )
    if not 0 <= env.rank < env.world_size:
        raise MisconfigurationError(f"RANK={env.rank} is outside [0, WORLD_SIZE={env.world_size}).")


def check_cpu_processes(nprocs: int, device_type: str, cores: int | None = None) -> None:
    """Refuse (or warn about) more CPU processes than this machine can run, before starting any."""
    cores = cores or os.cpu_count() or 1
    if device_type != "cpu" or nprocs <= cores:
        return
    if nprocs > MAX_CPU_RANKS_PER_CORE * cores:
        raise MisconfigurationError(
            f"devices={nprocs} CPU processes on a machine with {cores} core(s): each process imports torch and "
            f"needs memory and CPU, so they would thrash and fail at start-up. Use at most "
            f"{MAX_CPU_RANKS_PER_CORE * cores} here (devices <= {cores} runs at full speed), use GPUs "
            "(accelerator='cuda'), or spread the job over nodes (num_nodes=...). If you really mean it, start the "
            "processes yourself with torchrun or `phalanx run`."
        )
    notice(f"{nprocs} CPU processes on {cores} core(s): each gets one thread and they share the cores; "
           "expect it to be slow (fine for testing a multi-process script).")


def _threads_per_rank(nprocs: int) -> None:
    # N ranks each using every core thrash the CPU; give each its share unless the user chose.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nprocs))


def record_failure(error: BaseException) -> None:
    """Write ``error`` where torch's elastic launcher (torchrun, ``phalanx run``, ``fabric.launch``) looks for
    a failed rank's cause, so its summary names the cause instead of an exit code. Writes nothing outside
    such a launcher, and never replaces what is already there: the first cause wins."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    from phalanx.distributed.callsites import describe_exception

    # torchelastic's error-file format (what its @record decorator writes), with the exception's own
    # traceback: this may run in a thread or at exit, where no exception is "being handled". The message
    # says where the exception was raised (the user's file:line), so the launcher's summary can too; phalanx's
    # entry says whether a restart can fix it.
    data = {"message": {"message": describe_exception(error), "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
        "timestamp": str(int(time.time())),
        RECORD_KEY: restart_record(error),
    }}}
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        pass


def restart_count() -> int:
    """How many times torch's elastic agent restarted this job's processes (0 on the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def check_max_restarts(max_restarts: int) -> int:
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise MisconfigurationError(f"max_restarts={max_restarts!r}: give a whole number >= 0 (how many times the "
                                    "launcher restarts the job's processes after one fails).")
    return max_restarts


#: The signals torch's agent (the launching process) passes on to the ranks: its defaults plus SIGUSR1, so
#: SLURM's early warning reaches the ranks, which must see it to checkpoint before the kill.
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def prepare_agent_process() -> None:
    """What a process does before it runs torch's elastic agent (``fabric.launch``, ``phalanx run``): the
    agent passes the preemption signals on (set in the environment too, for torch versions whose launcher
    reads them only there), and the process leaves without the final garbage collection once its ranks
    are done (it waits for their exit, then its own: see :mod:`phalanx.utils.exiting`)."""
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = AGENT_SIGNALS
    exiting.freeze_at_exit()


def new_run_id() -> str:
    return f"phalanx-{uuid.uuid4().hex[:8]}"


def _launch_config(nprocs: int, logs: RunLogs, max_restarts: int = 0) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    extra: dict[str, Any] = (
        {"signals_to_handle": AGENT_SIGNALS} if "signals_to_handle" in LaunchConfig.__dataclass_fields__ else {}
    )
    return LaunchConfig(
        **extra,
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=logs.run_id,
        logs_specs=logs.logs_specs(),
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )


def script_command() -> list[str]:
    """How to re-run the current program: ``python script.py args`` or ``python -m pkg args``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return ["-m", name, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.exists(script):
        raise MisconfigurationError(
            "fabric.launch() with devices>1 re-runs your script in N processes, but this program is not a "
            "script file (python -c or an interactive session). Put the code in a file, or use "
            "fabric.launch(fn) with a module-level function, or start it with `phalanx run`."
        )
    return [os.path.abspath(script), *sys.argv[1:]]


def launch_script(nprocs: int, max_restarts: int = 0, root: str | os.PathLike[str] | None = None) -> int:
    """Re-run this script in ``nprocs`` processes and wait; returns the job's exit code. ``root``: the run's
    root folder, where its log folder goes (:func:`phalanx.distributed.runlogs.log_root`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    command = script_command()
    _threads_per_rank(nprocs)
    prepare_agent_process()
    # The ranks run the script again (launch(fn)'s import it): what it said before the launch was said here.
    logs = RunLogs(new_run_id(), root=log_root(root), ranks=nprocs, environ={RELAUNCHED_VARIABLE: "1"},
                   max_restarts=max_restarts)
    try:
        with logs:
            elastic_launch(_launch_config(nprocs, logs, max_restarts), sys.executable)(*command)
    except (ChildFailedError, NotRestarted) as err:
        return logs.report_failure(err)
    except SignalException as err:
        # torch's agent passed the signal on to the ranks and waited for them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
        # 30 s by default): a Trainer or a loop asking fabric.stop_requested() saved and said so.
        return logs.report_signal(err.sigval)
    return 0


def _function_entry(factory: Callable[[], Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    fabric = factory()
    fabric.launch()
    try:
        result = fn(fabric, *args)
    except Exception as err:
        fabric.teardown(err)  # peers waiting on this rank learn why at once, and the launcher (error file)
        # The traceback goes to this rank's stderr (its log file when phalanx redirects it). Exiting instead
        # of raising keeps the error file phalanx wrote (torch's @record would replace it with a message
        # that does not say where the error was raised) and keeps torch's agent from logging the traceback
        # a second time. The rank's exit code is 1 either way.
        record_failure(err)  # in case the rank failed before it joined the process group
        traceback.print_exc()
        sys.stderr.flush()
        raise SystemExit(1) from None
    except BaseException as err:
        fabric.teardown(err)
        raise
    # This process stays alive until every rank has returned (the launcher collects return values), so
    # it must leave the group now: a peer still inside a collective then fails at once, naming this rank,
    # instead of waiting for the process-group timeout.
    fabric.teardown()
    return result


def launch_function(
    nprocs: int, factory: Callable[[], Any], fn: Callable[..., Any], args: tuple[Any, ...], max_restarts: int = 0,
    root: str | os.PathLike[str] | None = None,
) -> Any:
    """Run ``fn(fabric, *args)`` in ``nprocs`` processes; returns rank 0's return value."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if getattr(fn, "__qualname__", "").count("<locals>") or getattr(fn, "__name__", "") == "<lambda>":
        raise MisconfigurationError(
            f"fabric.launch(fn) starts new processes that import `fn` by name, so it must be a module-level "
            f"function; {fn!r} is a lambda or nested function."
        )
    _threads_per_rank(nprocs)
    prepare_agent_process()
    # The ranks run the script again (launch(fn)'s import it): what it said before the launch was said here.
    logs = RunLogs(new_run_id(), root=log_root(root), ranks=nprocs, environ={RELAUNCHED_VARIABLE: "1"},
                   max_restarts=max_restarts)
    try:
        with logs:
            results = elastic_launch(_launch_config(nprocs, logs, max_restarts), _function_entry)(factory, fn, args)
    except SignalException as err:  # passed on to the ranks, as under launch_script; this process ends likewise
        code = logs.report_signal(err.sigval)
        if code == EXIT_PREEMPTED:
            raise Preempted(f"the launcher received {signal_name(err.sigval)}") from None
        raise SystemExit(code) from None
    except (ChildFailedError, NotRestarted) as err:
        preempted = preempted_summary(err)
        if preempted is not None:  # rank 0 printed the line; end this process the same way (exit code 75)
            raise Preempted(preempted) from None
        summary, _ = failure_summary(err, logs.ranks, logs.oom)
        where = logs.failed_logs(err)
        why = f" Not restarted: {err.why}." if isinstance(err, NotRestarted) else ""
        error = PhalanxError(f"fabric.launch({getattr(fn, '__name__', fn)}) failed: {summary}.{why}"
                             + (f" {where.removeprefix('[phalanx] ')}" if where else ""))
        if where:  # torch's error block (the ranks' tracebacks again) is in the log: leave it out here
            raise error from None
        raise error from err
    return results.get(0)
