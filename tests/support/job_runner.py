"""Running real multi-process jobs from tests.

A test runs a job program, a file under tests/support/jobs/ (``run_job(JOBS / "name.py", tmp_path, args=...)``,
its parameters on the command line), copied into the test's folder as ``job.py``; the program builds a
``Fabric(devices=N)`` and calls ``fabric.launch()``, which re-runs it in N processes through phalanx's launcher,
exactly as a user's ``python train.py`` would. Each rank reports values with ``report(fabric, **values)`` (JSON under
``PHALANX_TEST_OUT``); the test reads them back per rank. Every job has a hard timeout: a hung job
fails the test instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORT = Path(__file__).resolve().parent  # tests/support: the helpers that tests and jobs import
JOBS = SUPPORT / "jobs"  # the job programs, one module per program (or per family)
TESTS = SUPPORT.parent
REPO = TESTS.parent
# What a job script needs to import: the support modules as top-level modules (``from job_runner import report``),
# the tests package and phalanx from src.
JOB_PYTHONPATH = os.pathsep.join(str(path) for path in (SUPPORT, REPO, REPO / "src"))


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def check(self) -> Job:
        assert self.returncode == 0, f"job failed ({self.returncode}):\n{self.output[-6000:]}"
        return self


def run_job(
    code: str | Path,
    tmp_path: Path,
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    command: list[str] | None = None,
    name: str = "job.py",
) -> Job:
    """Write ``code`` (a program's text, or a file under ``JOBS``) to ``tmp_path/name`` and run it there, as a
    user runs ``python train.py``; ``command`` replaces ``python script`` (e.g. phalanx run)."""
    script = tmp_path / name
    script.write_text(_program(code))
    out_dir = tmp_path / "reports"
    out_dir.mkdir(exist_ok=True)
    full_env = {**os.environ, "PHALANX_TEST_OUT": str(out_dir), "PYTHONPATH": JOB_PYTHONPATH}
    full_env.pop("PHALANX_SEED", None)
    full_env.update(env or {})
    cmd = (command or [sys.executable]) + [str(script), *args]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        raise AssertionError(
            f"job hung for more than {timeout}s:\n{(err.stdout or b'')[-3000:]!r}\n{(err.stderr or b'')[-3000:]!r}"
        ) from None
    job = Job(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)
    for path in sorted(out_dir.glob("rank*.json")):
        job.reports[int(path.stem[4:])] = json.loads(path.read_text())
    return job


def _program(code: str | Path) -> str:
    return code.read_text() if isinstance(code, Path) else textwrap.dedent(code)


def line_of(job: Path, text: str) -> int:
    """The line of the job program at ``job`` that holds ``text``, as tracebacks and phalanx's messages cite it."""
    return next(i for i, line in enumerate(job.read_text().splitlines(), start=1) if text in line)


def assert_terminal(stderr: str, strategy: str, *expected: str) -> None:
    """What a job's terminal said (its stderr) is exactly ``expected``: lines, or patterns where one starts with
    ``re:``. Under FSDP and DeepSpeed, whose own warnings (and phalanx's notices about them) come and go, the
    expected lines must be among phalanx's ``[phalanx]`` lines, in order."""
    lines = stderr.splitlines()
    if strategy != "ddp":
        lines = [line for line in lines if line.startswith("[phalanx]")]
    found = iter(lines)
    for want in expected:
        pattern = want[3:] if want.startswith("re:") else re.escape(want)
        assert any(re.fullmatch(pattern, line) for line in found), (want, stderr[-3000:])
    assert strategy != "ddp" or len(lines) == len(expected), stderr[-3000:]


def run_logs(tmp_path: Path) -> str:
    """Every rank's stderr of the jobs run in ``tmp_path`` by phalanx's launchers (they write it to
    ``./phalanx_logs/<run>/.../attempt_0/<rank>/stderr.log`` and show it on the terminal without tracebacks)."""
    logs = sorted(tmp_path.glob("phalanx_logs/*/*/attempt_*/*/stderr.log"))
    return "".join(path.read_text(errors="replace") for path in logs)


def report(fabric: Any = None, /, **values: Any) -> None:
    """Called inside a job: record JSON-able values (tensors become lists) for this rank: the fabric's, else the
    `rank=` keyword's (default 0). `rank` is read from `values` so that `report(fabric, **{key: value})` type-checks
    for any key."""
    rank = values.pop("rank", None)
    rank = fabric.global_rank if fabric is not None else (rank or 0)
    out = Path(os.environ["PHALANX_TEST_OUT"]) / f"rank{rank}.json"
    current = json.loads(out.read_text()) if out.exists() else {}
    current.update({k: _plain(v) for k, v in values.items()})
    # Whole or not at all: a rank can be ended mid-write (the launcher stops the others once one fails), and a
    # truncated report would fail the runner's read instead of the test's assertions.
    partial = out.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(current))
    os.replace(partial, out)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double().tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in module.parameters()])


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_mid_run(code: str | Path, tmp_path: Path, ranks: int, delay: float, ready_timeout: float = 150,
                 args: tuple[str, ...] = ()) -> None:
    """Run ``code`` (a launched job whose ranks write their pid to ``pid<rank>`` and whose rank 0 writes
    a ``ready`` file once the state to check is in place), wait ``delay`` seconds after ``ready``, then
    SIGKILL every rank and the launcher. Returns once none of them runs any more.

    The ranks run in sessions of their own (torch's launcher starts them so), so killing the launcher's
    process group would leave them running: a rank could go on saving, and publish, while the test
    reads the checkpoint. Each rank is killed by its pid instead."""
    (tmp_path / "job.py").write_text(_program(code))
    env = {**os.environ, "PHALANX_TEST_OUT": str(tmp_path), "PYTHONPATH": JOB_PYTHONPATH}
    proc = subprocess.Popen([sys.executable, "job.py", *args], cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + ready_timeout
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the job never became ready"
            time.sleep(0.05)
        pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(ranks)]
        time.sleep(delay)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in pids):
        assert time.monotonic() < deadline, "a killed rank is still running"
        time.sleep(0.05)


# ---------------------------------------------------------------- ranks started by hand, orphans, ports
def live_processes(marker: str) -> list[int]:
    """Pids (not zombies) whose command line mentions ``marker`` (a test's unique tmp_path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def assert_no_orphans(marker: str | Path, grace: float = 5.0) -> None:
    deadline = time.monotonic() + grace
    while (pids := live_processes(str(marker))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pids, f"processes outlived the job: {pids}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_by_hand(script: Path, world: int, env: dict[str, str],
                  args: tuple[str, ...] = ()) -> list[subprocess.Popen[str]]:
    """Start ``world`` ranks the way a cluster scheduler would: env vars only, nobody supervising. Each
    rank's output goes to ``rank<N>.log`` next to ``script``; ``env`` is added to this process's environment and
    ``args`` follow the script on each rank's command line."""
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = {
            **os.environ, **env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "PYTHONPATH": JOB_PYTHONPATH,
        }
        out = open(script.with_name(f"rank{rank}.log"), "w")  # the child keeps its own copy of the handle
        procs.append(
            subprocess.Popen([sys.executable, str(script), *args], env=rank_env, stdout=out, stderr=subprocess.STDOUT,
                             cwd=script.parent, text=True)
        )
    return procs


def wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)
