"""``phalanx run --replica-groups N``: a fault-tolerant job on one machine, on torchft's lighthouse and torch's agent.

The launcher starts torchft's lighthouse (``torchft_lighthouse``, shipped by the torchft wheel) and one ``phalanx run``
per replica group: each is torch's elastic agent with its own store (``--standalone``) over ``--devices`` processes,
restarting only its own group (``--max-restarts``) while the others go on. It tells each group where the lighthouse is
and which group it is (:data:`~phalanx.distributed.replica_groups.LIGHTHOUSE_VARIABLE`, ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS``: on SLURM, or with one torchrun per group, set the same variables yourself).

What reaches the terminal: group 0's output as ``phalanx run`` shows it, and every other group's ``[phalanx]`` lines
(fault lines, errors); everything each group printed, torchft's own logs included, is in ``<log folder>/group-<g>.log``
and the lighthouse's in ``lighthouse.log``. Every process the launcher started, the lighthouse included, is ended when
it returns: on success, on error, on Ctrl-C and on SIGTERM (passed on to every group first, so that their ranks take
the agreed preemption stop and save). A preemption of one group alone (SIGTERM to its processes, as a scheduler
preempts one node) stops that group with its checkpoint; the others go on, and the job ends with 0 once they finish it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

from phalanx.distributed.launch import new_run_id
from phalanx.distributed.preemption import EXIT_PREEMPTED
from phalanx.distributed.replica_groups import (
    GROUP_VARIABLE,
    GROUPS_VARIABLE,
    LIGHTHOUSE_VARIABLE,
    MIN_GROUPS_VARIABLE,
    require_torchft,
)
from phalanx.distributed.runlogs import DIR_VARIABLE, log_root, shown_path
from phalanx.utils.errors import MisconfigurationError

#: torchft's log lines (its Rust manager's and its Python loggers'): kept out of the terminal.
_TORCHFT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+ \[\w+\] \[torchft|^\[?torchft|^INFO:torchft|^WARNING:torchft"
                           r'|"GET /checkpoint/')  # the last: the access log of torchft's checkpoint server
#: Seconds to wait for the groups after passing a signal on (their agents wait for the ranks to save).
SHUTDOWN_SECONDS = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")) + 10
#: Seconds the groups get to stop by themselves once the lighthouse is gone (they notice within a few seconds, and
#: a restarted group fails to reach it at start-up): then the launcher stops what is left.
LIGHTHOUSE_SECONDS = 15.0
#: Seconds the other groups get to finish once one group finished the job.
FINISH_SECONDS = 15.0


@dataclass(frozen=True)
class LighthouseSettings:
    """``torchft_lighthouse``'s flags. ``heartbeat_timeout_ms``: a group silent this long is out of the next
    quorum (a dead or frozen group costs the others about this much); ``join_timeout_ms``: how long a new quorum
    waits for groups that are alive but not asking yet (start-up)."""

    min_replicas: int = 1
    join_timeout_ms: int = 10000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 2000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lighthouse_binary() -> str:
    """The ``torchft_lighthouse`` executable of the installed torchft."""
    require_torchft()
    found = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    if not os.access(found, os.X_OK):
        raise MisconfigurationError("torchft is installed but its torchft_lighthouse program is not on PATH: "
                                    f"reinstall it (`pip install 'phalanx[ft]'`) or add {Path(found).parent} to PATH.")
    return found


class Lighthouse:
    """A ``torchft_lighthouse`` process on a free port of this machine, its output in ``log``."""

    def __init__(self, settings: LighthouseSettings, log: Path) -> None:
        self.port = _free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self._log = log.open("ab")
        self.process = subprocess.Popen(
            [lighthouse_binary(), "--min_replicas", str(settings.min_replicas), "--bind", f"[::]:{self.port}",
             "--join_timeout_ms", str(settings.join_timeout_ms), "--quorum_tick_ms", str(settings.quorum_tick_ms),
             "--heartbeat_timeout_ms", str(settings.heartbeat_timeout_ms)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise MisconfigurationError(f"torchft_lighthouse exited at start with code {self.process.returncode}; "
                                            f"see {log}.")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return
            time.sleep(0.05)
        self.stop()
        raise MisconfigurationError(f"torchft_lighthouse did not listen on port {self.port} within 30 s; see {log}.")

    def stop(self) -> None:
        _end(self.process, signal.SIGTERM, 5.0)
        self._log.close()


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc; torch's agent starts each rank in a session of its own, so a
    signal to the agent's process group does not reach them)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent = int(stat[stat.rindex(")") + 2:].split()[1])
                children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _end(process: subprocess.Popen[bytes], sig: int, grace: float) -> None:
    """Send ``sig`` to ``process``'s session, then SIGKILL it and every process below it still there after ``grace``
    seconds."""
    below = _descendants(process.pid)
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    for pid in {*below, *_descendants(process.pid)}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5.0)


class _Group:
    """One replica group: its ``phalanx run`` agent, and the thread that sorts its output."""

    def __init__(self, group: int, command: list[str], env: dict[str, str], log: Path, terminal: TextIO) -> None:
        self.group, self.log = group, log
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        self._thread = threading.Thread(target=self._pump, args=(terminal,), daemon=True,
                                        name=f"phalanx-group{group}-output")
        self._thread.start()

    def _pump(self, terminal: TextIO) -> None:
        assert self.process.stdout is not None
        with self.log.open("a", encoding="utf-8", errors="replace") as out:
            for raw in iter(self.process.stdout.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                out.write(line)
                out.flush()
                if _TORCHFT_LINE.search(line):
                    continue
                if self.group == 0 or line.startswith("[phalanx]"):
                    terminal.write(line)
                    terminal.flush()

    def join(self) -> None:
        self._thread.join(timeout=5.0)


def run_groups(groups: int, devices: int, max_restarts: int, min_groups: int, script: str, script_args: list[str],
               extra_run_args: list[str], settings: LighthouseSettings | None = None,
               terminal: TextIO | None = None) -> int:
    """Run ``script`` as ``groups`` fault-tolerant replica groups of ``devices`` processes each; returns the job's
    exit code: 0 when every group finished, or when the groups that did not stopped for a preemption (the others
    completed the job without them); 75 when every group stopped for a preemption; else the first failed group's
    code."""
    if groups < 1 or min_groups < 1 or min_groups > groups:
        raise MisconfigurationError(f"--replica-groups {groups} with --min-replica-groups {min_groups}: give "
                                    "1 <= min <= groups.")
    terminal = terminal or sys.stdout
    folder = Path(log_root(None)) / new_run_id()
    folder.mkdir(parents=True, exist_ok=True)
    settings = settings or LighthouseSettings(min_replicas=min_groups)
    lighthouse = Lighthouse(settings, folder / "lighthouse.log")
    threads = max(1, (os.cpu_count() or 1) // (groups * devices))
    started: list[_Group] = []
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        for g in started:
            if g.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(g.process.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        for number in range(groups):
            env = {**os.environ, LIGHTHOUSE_VARIABLE: lighthouse.address, GROUP_VARIABLE: str(number),
                   GROUPS_VARIABLE: str(groups), MIN_GROUPS_VARIABLE: str(min_groups),
                   DIR_VARIABLE: str(folder / f"group-{number}"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                                                             str(threads))}
            command = [sys.executable, "-m", "phalanx.cli", "run", "--devices", str(devices), "--max-restarts",
                       str(max_restarts), *extra_run_args, script, *script_args]
            started.append(_Group(number, command, env, folder / f"group-{number}.log", terminal))
        codes = _wait(started, lighthouse, received, terminal)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for g in started:
            _end(g.process, signal.SIGTERM, 5.0)
            g.join()
        lighthouse.stop()
    failed = {g: c for g, c in codes.items() if c != 0}
    if not failed:
        return 0
    if all(c == EXIT_PREEMPTED for c in failed.values()):
        if len(failed) == len(codes):
            return EXIT_PREEMPTED
        # A preempted group left; the others completed the job. Exit 75 would tell a scheduler to requeue a job
        # that is done (and a rerun would resume from the preempted group's older checkpoint).
        finished = sorted(set(codes) - set(failed))
        terminal.write(f"[phalanx] replica group{'s' if len(failed) > 1 else ''} {', '.join(map(str, sorted(failed)))} "
                       f"stopped for a preemption; group{'s' if len(finished) > 1 else ''} "
                       f"{', '.join(map(str, finished))} finished the job.\n")
        terminal.flush()
        return 0
    where = shown_path(str(folder))
    terminal.write(f"[phalanx] replica groups {sorted(failed)} ended with exit codes {sorted(set(failed.values()))} "
                   f"({len(codes) - len(failed)} of {len(codes)} finished). Logs: {where}\n")
    terminal.flush()
    return next(iter(failed.values()))


def _wait(started: list[_Group], lighthouse: Lighthouse, received: list[int], terminal: TextIO) -> dict[int, int]:
    """Wait for every group; a group that gave up leaves the others running. If the lighthouse dies, the groups fail
    by themselves (their next quorum cannot form): the launcher says so and stops whatever is left after their
    timeout."""
    codes: dict[int, int] = {}
    lighthouse_gone: float | None = None
    signalled: float | None = None
    finished: float | None = None
    while len(codes) < len(started):
        for g in started:
            if g.group not in codes and g.process.poll() is not None:
                codes[g.group] = int(g.process.returncode)
                if codes[g.group] == 0 and finished is None:
                    finished = time.monotonic()
        # The job is done once a group finished: the others finish at the same step. A group still there after
        # FINISH_SECONDS was restarting: alone, it would train again from its start.
        if finished is not None and time.monotonic() - finished > FINISH_SECONDS:
            for g in started:
                if g.group not in codes:
                    terminal.write(f"[phalanx] replica group {g.group} was still joining when the job finished "
                                   "(another group completed it); it was stopped.\n")
                    terminal.flush()
                    _end(g.process, signal.SIGTERM, 5.0)
                    codes[g.group] = 0
        if lighthouse_gone is None and lighthouse.process.poll() is not None and len(codes) < len(started):
            lighthouse_gone = time.monotonic()
            terminal.write(f"[phalanx] the torchft lighthouse at {lighthouse.address} exited (code "
                           f"{lighthouse.process.returncode}): no quorum can form, every replica group stops.\n")
            terminal.flush()
        if received and signalled is None:
            signalled = time.monotonic()
        late = (lighthouse_gone is not None and time.monotonic() - lighthouse_gone > LIGHTHOUSE_SECONDS) or (
            signalled is not None and time.monotonic() - signalled > SHUTDOWN_SECONDS)
        if late:
            for g in started:
                if g.group not in codes:
                    _end(g.process, signal.SIGTERM, 5.0)
                    codes[g.group] = int(g.process.returncode if g.process.returncode is not None else 1)
        time.sleep(0.1)
    return codes


__all__ = ["Lighthouse", "LighthouseSettings", "lighthouse_binary", "run_groups"]
