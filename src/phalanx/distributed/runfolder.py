"""What phalanx keeps in a run's folder: the claim of the run that is using it, and the record of a run that
was preempted there.

The run's folder is the Trainer's ``default_root_dir`` (a Fabric's ``root_dir``, else its first logger's, else
the working directory, for the preemption record). Two runs in one folder would overwrite each other's
checkpoints and logger version, and a restart or a rerun of one could resume the other's state: another model,
other settings, no error. So:

* **The claim** (``.phalanx-run.lock``): an exclusive ``flock`` the fit's rank 0 holds from before it writes
  anything until the fit ends; a second fit in the folder is refused, naming the process that holds it. The
  kernel lets go when the holder ends, however it ends (``kill -9`` included), so a restarted attempt or a
  rerun claims it again at once. The file says who holds it and since when; a restarted attempt reads there
  when its run started and what it resumed from, so that it resumes from its own run's state only.
* **The preemption record** (``preempted.json``): written by rank 0 once the preemption checkpoint is
  complete, so the next run of the same command finds it and resumes from that checkpoint; nothing starts
  afresh over it. It goes when a run that resumed from it ends well.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from phalanx.distributed.runlogs import shown_path as shown
from phalanx.utils.errors import MisconfigurationError

CLAIM = ".phalanx-run.lock"
PREEMPTED = "preempted.json"


def _command() -> str:
    return shlex.join([os.path.basename(sys.executable), *sys.argv]) if sys.argv else "python"


def _from_json(cls: Any, text: str) -> Any:
    """An instance of the dataclass ``cls`` from its JSON (None unless every field is there)."""
    try:
        data = json.loads(text)
        return cls(**{f.name: data[f.name] for f in fields(cls)})
    except (ValueError, TypeError, KeyError):
        return None


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # the rename itself reaches the disk (not possible everywhere)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------ the claim
def restarts_left() -> bool:
    """Whether the launcher may still restart this job's processes (torch's agent says how many it allows)."""
    try:
        allowed = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return False
    return done < allowed


@dataclass(frozen=True)
class RunRecord:
    """Who holds a run folder: the process, its command, the launcher's run id (the same for every attempt of
    a restarting job), when the run started, and the checkpoint it resumed from (None: it started afresh)."""

    pid: int
    host: str
    command: str
    run_id: str
    started: float
    resumed_from: str | None = None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}, `{self.command}`, since {when}"


class RunClaim:
    """This process's hold on a run folder, until :meth:`release` (or until the process ends).

    Raises MisconfigurationError while another process holds it, or another Trainer of this process. On a
    restarted attempt (``restarted``) of the run that held it last (the same launcher run id), the run's
    start and the checkpoint it resumed from carry over (:attr:`record`)."""

    def __init__(self, folder: Path, restarted: bool = False) -> None:
        self.folder = folder
        self.path = folder / CLAIM
        folder.mkdir(parents=True, exist_ok=True)
        fd = self._lock()
        try:
            previous: RunRecord | None = _from_json(RunRecord, os.pread(fd, 1 << 16, 0).decode(errors="replace"))
            run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
            record = RunRecord(os.getpid(), socket.gethostname(), _command(), run_id, time.time())
            if restarted and previous is not None and run_id and previous.run_id == run_id:
                record = replace(record, started=previous.started, resumed_from=previous.resumed_from)
            self._fd: int | None = fd
            self.record = record
            self._write()
        except BaseException:
            os.close(fd)
            raise

    def _lock(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _from_json(RunRecord, os.pread(fd, 1 << 16, 0).decode(errors="replace"))
                os.close(fd)
                raise MisconfigurationError(self._refusal(holder)) from None
            except BaseException:
                os.close(fd)
                raise
            # A holder that was letting go removed the file between our open and our lock: lock the new one.
            try:
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def _refusal(self, holder: RunRecord | None) -> str:
        if holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname():
            who = f"Another Trainer of this process (pid {holder.pid}) is fitting"
        else:
            who = f"Another run ({holder.describe()}) is running" if holder is not None else "Another run is running"
        return (f"{who} in {shown(str(self.folder))}: two runs in one folder would overwrite each other's "
                "checkpoints and logs and resume each other's state. Give this run its own folder "
                "(Trainer(default_root_dir=...), the main job's --out), or wait until the other run ends.")

    def _write(self) -> None:
        if self._fd is not None:
            data = json.dumps(asdict(self.record)).encode()
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)

    def resumed_from(self, path: str | os.PathLike[str] | None) -> None:
        """Record the checkpoint this run resumed from (where its restarted attempts may resume too)."""
        self.record = replace(self.record, resumed_from=os.path.abspath(path) if path is not None else None)
        self._write()

    def release(self, ended_well: bool = True) -> None:
        """Let go of the folder. The lock file is deleted first, while still held, unless a restarted attempt
        may follow (the fit failed, or its script may fail after it under a restarting launcher): that attempt
        reads there when its run started and what it resumed from."""
        if self._fd is None:
            return
        if ended_well and not restarts_left():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None


# ------------------------------------------------------------------------------------------ preempted runs
@dataclass(frozen=True)
class PreemptedRun:
    """A run that stopped for a preemption, with a complete checkpoint: where (an absolute path), the step
    (None: the loop did not say), the agreed stop ("SIGTERM on rank 1"), the command, and when."""

    checkpoint: str
    step: int | None
    stop: str
    command: str
    time: float

    @classmethod
    def now(cls, checkpoint: str | os.PathLike[str], step: int | None, stop: str) -> PreemptedRun:
        return cls(os.path.abspath(checkpoint), step, stop, _command(), time.time())

    @staticmethod
    def path(folder: Path) -> Path:
        return folder / PREEMPTED

    @classmethod
    def read(cls, folder: Path) -> PreemptedRun | None:
        """The record in ``folder``, or None. A record that cannot be read is an error, not a fresh start."""
        path = cls.path(folder)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        found: PreemptedRun | None = _from_json(cls, text)
        if found is None:
            raise MisconfigurationError(f"{shown(str(path))} (the record of a preempted run) cannot be read. Delete "
                                        "it to start afresh in this folder, or restore it to resume that run.")
        return found

    def write(self, folder: Path) -> None:
        """Write the record atomically (call once the checkpoint is complete)."""
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomically(self.path(folder), json.dumps(asdict(self), indent=1))

    @classmethod
    def remove(cls, folder: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            cls.path(folder).unlink()

    def at(self) -> str:
        return f" at step {self.step}" if self.step is not None else ""

    def is_checkpoint(self, path: str | os.PathLike[str]) -> bool:
        return os.path.abspath(path) == self.checkpoint


__all__ = ["CLAIM", "PREEMPTED", "PreemptedRun", "RunClaim", "RunRecord"]
