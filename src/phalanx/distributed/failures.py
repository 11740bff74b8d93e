"""What a failed attempt of a launched job says: the rank(s) that failed first and their cause, each once.

The launchers phalanx owns say it at the end of a job (:func:`report_failure`, :func:`report_signal`), and
hand it to the ranks of a restarted attempt, whose rank 0 quotes it in its one restart line
(:class:`AttemptRecorder`, :mod:`phalanx.distributed.restarts`). Ranks that only stopped because another
failed (stopped by the launcher, or raising an error that reports the other rank's) are named as a
consequence, not as causes, so the first failure stands out and the words do not depend on which of the
two happened first.

They restart only what a restart can fix (:func:`futile_restart`): not an error that says it will repeat (a
configuration error, a checkpoint that cannot be used, a folder another run holds), not a preemption, and not
an exception that repeats at the same step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.distributed.preemption import EXIT_PREEMPTED, Preempted
from phalanx.utils.errors import CollectiveError, PhalanxError, noted_step

#: Set by the launcher for the ranks of a restarted attempt: the previous attempt's failure, in words.
CAUSE_VARIABLE = "PHALANX_RESTART_CAUSE"
#: The key of what phalanx adds to a rank's error file (torchelastic's format, under ``message.extraInfo``).
RECORD_KEY = "phalanx"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# ------------------------------------------------------------------------------------------ the kernel's word
def oom_kills(cgroups: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup") -> int | None:
    """How many processes of this process's memory cgroup the kernel's out-of-memory killer has ended (the
    ``oom_kill`` counter of ``memory.events``, cgroup v2, or ``memory.oom_control``, v1); None where no such
    counter can be read. The ranks a launcher starts share its cgroup, so a rise while a rank died by SIGKILL
    is the kernel saying that it killed the rank for memory."""
    try:
        lines = Path(cgroups).read_text().splitlines()
    except OSError:
        return None
    files: list[Path] = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        inner = path.strip().lstrip("/")
        if controllers == "":
            files += [Path(mount, inner, "memory.events"), Path(mount, "memory.events")]
        elif "memory" in controllers.split(","):
            files += [Path(mount, "memory", inner, "memory.oom_control"), Path(mount, "memory", "memory.oom_control")]
    for file in files:
        try:
            rows = file.read_text().splitlines()
        except OSError:
            continue
        for row in rows:
            name, _, value = row.partition(" ")
            if name == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


# ------------------------------------------------------------------------------------------ the summary
@dataclass
class Recorded:
    """A failed rank known from the error file it wrote (``<attempt>/<rank>/error.json``), for the ranks torch's
    agent did not report: ``launch(fn)``'s agent reports only the first process it saw exit, and a restart
    reports none."""

    error_file: str
    error_file_data: dict[str, Any]
    exitcode: int = 1  # a Python exception ends a launched rank with 1

    @property
    def timestamp(self) -> int:
        message = self.error_file_data.get("message")
        extra = message.get("extraInfo") if isinstance(message, dict) else None
        try:
            return int(extra.get("timestamp", 0)) if isinstance(extra, dict) else 0
        except (TypeError, ValueError):
            return 0

    @classmethod
    def read(cls, path: str, exitcode: int = 1) -> Recorded:
        """The rank whose error file is ``path`` (an empty record where it wrote none)."""
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            data = {}
        return cls(path, data if isinstance(data, dict) else {}, exitcode)


def all_failures(err: Any) -> dict[int, Any]:
    """The agent's failures, plus the ranks that recorded an error beside them (``<attempt>/<rank>/error.json``)."""
    failures = dict(getattr(err, "failures", {}) or {})
    files = [getattr(f, "error_file", "") or "" for f in failures.values()]
    if len(failures) != 1 or not files[0]:
        return failures
    attempt = os.path.dirname(os.path.dirname(files[0]))
    for entry in sorted(os.listdir(attempt)) if os.path.isdir(attempt) else []:
        path = os.path.join(attempt, entry, "error.json")
        if entry.isdigit() and int(entry) not in failures and os.path.isfile(path):
            failures[int(entry)] = Recorded.read(path)
    return failures


def recorded(failure: Any) -> str | None:
    """The one-line cause a rank wrote to its error file, if it wrote one."""
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message") if isinstance(data, dict) else None
    text = message.get("message") if isinstance(message, dict) else message
    if not text or text == "<NONE>":  # torch's placeholder when the rank wrote nothing
        return None
    return " ".join(str(text).split())[:2000]


def _when(failure: Any) -> int:
    try:
        return int(getattr(failure, "timestamp", 0) or 0)
    except (TypeError, ValueError):
        return 0


# Seconds: a killed rank's end is seen within the agent's poll (0.1 s) of its peer's report, a frozen one's
# only after torch's agent gave it SIGTERM's grace (30 s) and sent SIGKILL.
_STOP_GRACE = 10


def _reports(text: str, rank: int) -> bool:
    """Whether an error's words only report rank ``rank``'s failure (phalanx's own phrases for it)."""
    return any(phrase in text for phrase in (
        f"rank {rank} failed: ", f"failed on rank {rank}: ", f"because rank {rank} stopped sending heartbeats",
        f"because rank {rank} is gone", f"rank {rank} has not sent a heartbeat"))  # the last: the watchdog's verdict


def causes(failures: dict[int, Any]) -> list[tuple[int, Any]]:
    """The ranks that failed on their own, first-failed first: not stopped by the launcher (SIGTERM), and
    not raising an error that reports the failure of another rank which ended before it or about when it
    did (:data:`_STOP_GRACE`). A frozen rank ends only when the launcher, stopping the job after its peer
    reported it, SIGKILLs it at the end of torch's grace period: there the report, which names the frozen
    rank and the operation, is the cause."""
    own = {r: f for r, f in failures.items() if getattr(f, "exitcode", 1) != -signal.SIGTERM} or failures
    causes = {r: f for r, f in own.items()
              if not any(_reports(recorded(f) or "", other) and _when(g) < _when(f) + _STOP_GRACE
                         for other, g in own.items() if other != r)} or own
    return sorted(causes.items(), key=lambda item: (recorded(item[1]) is None, _when(item[1]), item[0]))


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def failure_summary(err: Any, ranks: int | None = None, oom: int | None = None) -> tuple[str, int]:
    """Words for a launcher's ChildFailedError (anything with ``failures``: rank -> exitcode, error file), and
    the job's exit code (the first-failed rank's: 128 + N for one signal N killed), e.g. "rank 1 was killed by
    SIGKILL; rank 0 stopped as a consequence". Ranks that
    failed alike are named together; a rank that recorded its error (phalanx does, see
    :func:`phalanx.distributed.launch.record_failure`) is quoted. ``ranks``: how many the attempt had (ranks
    not among the failures stopped as a consequence); ``oom``: how many out-of-memory kills the kernel counted
    meanwhile (:func:`oom_kills`), the evidence that a rank killed by SIGKILL was killed for memory."""
    failures = all_failures(err)
    first = causes(failures)
    groups: list[tuple[list[int], str, str | None]] = []  # (ranks, how they ended, cause)
    code = 0
    for rank, failure in first:
        exitcode = getattr(failure, "exitcode", 1)
        if exitcode < 0:
            how = f"killed by {signal_name(-exitcode)}"
            code = code or 128 - exitcode  # as a shell reports a process a signal ended (137: SIGKILL)
            if -exitcode == signal.SIGKILL and oom:
                how += (f" (the kernel's out-of-memory killer: this cgroup's oom_kill count rose by {oom}; give the "
                        "job more memory or use less, e.g. a smaller batch or fewer dataloader workers)")
        else:
            how = f"exited with code {exitcode}"
            code = code or exitcode
        cause = recorded(failure)
        same = next((g for g in groups if g[1] == how and g[2] == cause), None)
        if same is not None and cause is not None:
            same[0].append(rank)
        else:
            groups.append(([rank], how, cause))
    parts = []
    for who, how, cause in groups:
        verb = ("was " if len(who) == 1 else "were ") if how.startswith("killed") else ""
        parts.append(f"{_who(who)} {verb}{how}: {cause}" if cause else f"{_who(who)} {verb}{how}")
    named = {r for r, _ in first}
    stopped = sorted((set(failures) | set(range(ranks or 0))) - named)
    if stopped and parts:
        parts.append(f"{_who(stopped)} stopped as a consequence")
    return "; ".join(parts) or str(err), code or 1


def preempted_summary(err: Any) -> str | None:
    """The preemption line rank 0 recorded, when every rank that ended on its own ended preempted."""
    first = causes(all_failures(err))
    if not first or any(getattr(f, "exitcode", 1) != EXIT_PREEMPTED for _, f in first):
        return None
    return next((text for _, f in first if (text := recorded(f))), "preempted").removeprefix("Preempted: ")


# ------------------------------------------------------------------------------------------ restart or not
def restart_record(error: BaseException) -> dict[str, Any]:
    """What a rank records about the error it ends with, for the launcher's decision to restart: ``unfixed``,
    why a restart cannot fix it (None: it may); ``transient``, whether it is a lost peer or a collective
    timeout (restarted even when it repeats); ``error``, ``step`` and ``where`` (its type, the training step
    it was raised at where known, the line that raised it), compared with the next attempt's."""
    if isinstance(error, Preempted):
        unfixed: str | None = "the job was preempted: it ends so that it can be moved, and its rerun resumes"
    else:
        unfixed = type(error).unfixed_by_restart if isinstance(error, PhalanxError) else None
    frames = error.__traceback__
    while frames is not None and frames.tb_next is not None:
        frames = frames.tb_next
    where = f"{os.path.basename(frames.tb_frame.f_code.co_filename)}:{frames.tb_lineno}" if frames else ""
    return {"unfixed": unfixed, "transient": isinstance(error, CollectiveError), "error": type(error).__name__,
            "step": noted_step(error), "where": where}


def _record_of(failure: Any) -> dict[str, Any]:
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message") if isinstance(data, dict) else None
    extra = message.get("extraInfo") if isinstance(message, dict) else None
    found = extra.get(RECORD_KEY) if isinstance(extra, dict) else None
    return found if isinstance(found, dict) else {}


def _signature(record: dict[str, Any]) -> str:
    step = record.get("step")
    return f"{record.get('error')} at step {step}" if isinstance(step, int) else \
        f"{record.get('error')} raised at {record.get('where')}"


def futile_restart(failures: dict[int, Any], previous: set[str], attempt: int) -> tuple[str | None, set[str]]:
    """Why restarting after attempt ``attempt`` (0: the first) cannot help, or None; and what to compare the
    next attempt with. ``failures``: the attempt's (:func:`all_failures`); ``previous``: what this function
    returned for the attempt before. A restart cannot help when a rank that failed on its own recorded an
    error that will repeat (or a preemption), or when every such rank failed with the same exception at the
    same step (where the step is unknown: at the same line) as in the attempt before. A rank killed by a
    signal, a lost peer and a collective timeout are restarted."""
    first = causes(failures)
    if any(getattr(f, "exitcode", 1) < 0 for _, f in first):  # killed by a signal: whatever the others said
        return None, set()
    records = [_record_of(f) for _, f in first]
    for record in records:
        if record.get("unfixed"):
            return str(record["unfixed"]), set()
    own = {_signature(r) for r in records if r and not r.get("transient")}
    if not own or len(own) < len(records):  # a rank without a record (killed by a signal) or a transient failure
        return None, set()
    if own <= previous:
        return (f"attempt {attempt} failed with the same {' and '.join(sorted(own))} as attempt {attempt - 1}, so a "
                "restart would fail the same way again"), own
    return None, own


class NotRestarted(Exception):
    """Raised in the launching process, while torch's agent handles a failed attempt, when a restart cannot
    help (:func:`futile_restart`): the agent stops the job instead of restarting it (it offers no other way
    to decide). ``failures``: the attempt's, in a ChildFailedError's shape; ``why``: the reason, in words."""

    def __init__(self, failures: dict[int, Any], why: str) -> None:
        super().__init__(why)
        self.failures, self.why = failures, why


@dataclass
class _Attempt:
    """A failed attempt as torch's agent reported it, in its ChildFailedError's shape."""

    failures: dict[int, Any]


class AttemptRecorder(logging.Handler):
    """In the launching process, while torch's agent runs the ranks: when an attempt fails (the agent's
    ``failed (exitcode: ...) local_rank: ...`` record, logged before it restarts or gives up), put its summary
    where a restarted attempt's ranks read it (:data:`CAUSE_VARIABLE` in this process's environment, which
    the agent copies into every rank it starts), and keep the kernel's out-of-memory count for the end.
    Where a restart would follow and cannot help (:func:`futile_restart`), raise :class:`NotRestarted`
    instead: torch's agent has no other place between a failure and its restart, and ends the job.
    ``error_file(attempt, rank)``: where that rank wrote its error ('' where unknown); ``max_restarts``: how
    many restarts the agent allows."""

    def __init__(self, error_file: Callable[[int, int], str], ranks: int | None, max_restarts: int = 0) -> None:
        super().__init__(logging.ERROR)
        self.error_file, self.ranks, self.max_restarts = error_file, ranks, max_restarts
        self.attempt = 0
        self.signatures: set[str] = set()  # the previous attempt's failures, for futile_restart
        self.baseline = oom_kills()
        self.oom: int | None = None  # the kills counted during the attempt that failed last

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if not str(record.msg).startswith("failed (exitcode") or len(args) < 2:
            return
        exitcode, local_rank = args[0], args[1]
        if not isinstance(exitcode, int) or not isinstance(local_rank, int):
            return
        now = oom_kills()
        self.oom = now - self.baseline if now is not None and self.baseline is not None else None
        self.baseline = now

        attempt = _Attempt({local_rank: Recorded.read(self.error_file(self.attempt, local_rank), exitcode)})
        summary, _ = failure_summary(attempt, self.ranks, self.oom)
        os.environ[CAUSE_VARIABLE] = summary
        failures = all_failures(attempt)
        why, self.signatures = futile_restart(failures, self.signatures, self.attempt)
        self.attempt += 1
        if why is not None and self.attempt <= self.max_restarts:
            raise NotRestarted(failures, why)


__all__ = ["CAUSE_VARIABLE", "RECORD_KEY", "AttemptRecorder", "NotRestarted", "Recorded", "all_failures", "causes",
           "failure_summary", "futile_restart", "oom_kills", "preempted_summary", "recorded", "restart_record",
           "signal_name"]
