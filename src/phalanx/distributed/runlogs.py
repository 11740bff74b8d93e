"""Where the output of a job phalanx launches goes, so that a failure reads once, at the end.

Under the launchers phalanx owns (``fabric.launch()`` and ``fabric.launch(fn)`` under ``python train.py``,
the Trainer with ``devices=N``, ``phalanx run``):

* the run's log folder is ``<root>/phalanx_logs/<run id>``: the root is the Trainer's ``default_root_dir``,
  a Fabric's first logger's ``root_dir`` (else the working directory), and the working directory under
  ``phalanx run`` (it starts before the script says anything); ``$PHALANX_LOG_DIR`` replaces
  ``<root>/phalanx_logs``. The ranks learn it (``PHALANX_RUN_LOGS``) so that their fault lines name it;
* each rank's **stdout and stderr** are written to files by torch's elastic agent itself
  (``DefaultLogsSpecs(redirects=Std.ALL)``, torchrun's ``--redirects 3 --log-dir``):
  ``<run folder>/<torch run id>_<x>/attempt_<n>/<local rank>/{stdout,stderr}.log``, unbuffered
  (``PYTHONUNBUFFERED=1`` for the ranks unless set). Nothing is lost: the files have all of it, tracebacks
  included;
* a thread shows them on the terminal as they grow (:mod:`phalanx.distributed.terminal`): stdout on stdout,
  stderr on stderr, each rank's lines whole, other ranks' than rank 0 behind ``[rankN]: ``, nothing glued to a
  progress bar, and of stderr everything but traceback blocks (training prints, progress bars, warnings,
  phalanx's notices);
* torch's agent logs (about a failed rank, its traceback for ``launch(fn)``, "Sending process ... closing
  signal", "Received 15 death signal") go to ``<run folder>/launcher.log`` instead of the terminal;
* a failed attempt's summary is recorded for the restarted ranks
  (:class:`phalanx.distributed.failures.AttemptRecorder`);
* at the end the launcher prints where the log is and the cause (:mod:`phalanx.distributed.failures`).

``PHALANX_SHOW_TRACEBACKS=1`` (``phalanx run --show-tracebacks``) turns the redirection off: every rank
prints to the terminal as torch's launcher does by default (the ranks' writes, unlabelled, as they come).
Under a plain ``torchrun`` phalanx changes nothing (its own ``--tee 3`` labels every line).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import sys
import threading
from types import TracebackType
from typing import Any, TextIO

from phalanx.distributed.failures import (
    CAUSE_VARIABLE,
    AttemptRecorder,
    NotRestarted,
    Recorded,
    all_failures,
    causes,
    failure_summary,
    preempted_summary,
    recorded,
    signal_name,
)
from phalanx.distributed.preemption import EXIT_PREEMPTED
from phalanx.distributed.terminal import Tail, Terminal, rank_label

SHOW_VARIABLE = "PHALANX_SHOW_TRACEBACKS"
DIR_VARIABLE = "PHALANX_LOG_DIR"
DEFAULT_DIR = "phalanx_logs"
#: Set by the launcher for its ranks: the run's log folder, which their fault lines name.
RUN_VARIABLE = "PHALANX_RUN_LOGS"
#: Set for the ranks whose output is shown from the files (unless the user set it): each print reaches its file
#: at once, so that it shows live and in its place among the rank's stderr lines.
_UNBUFFERED = "PYTHONUNBUFFERED"

# torch's agent loggers whose records move to launcher.log: about a failed rank, and the agent's own (e.g.
# "Received 15 death signal, shutting down workers", which a preemption's one line already says).
_AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing", "torch.multiprocessing",
                  "torch.distributed.elastic.agent")
_FAILURES_LOGGER = "torch.distributed.elastic.multiprocessing"
_POLL_SECONDS = 0.1
_SEE_ABOVE = "The failing rank's traceback is above (a rank killed by a signal leaves none)."
_SIGNAL_NOTE = "A rank killed by a signal leaves no traceback."


def log_root(run_root: str | os.PathLike[str] | None = None) -> str:
    """The folder that holds the run folders: ``$PHALANX_LOG_DIR``, else ``<run_root>/phalanx_logs`` (the
    working directory's when ``run_root`` is None)."""
    return os.environ.get(DIR_VARIABLE) or os.path.join(run_root or ".", DEFAULT_DIR)


def run_memory() -> str | None:
    """Where the attempts of this run leave what they said for the next (``<run folder>/said``), under a
    launcher phalanx owns; None elsewhere (a plain torchrun, ``PHALANX_SHOW_TRACEBACKS=1``)."""
    folder = os.environ.get(RUN_VARIABLE)
    return os.path.join(folder, "said") if folder else None


def said_in_run(key: str) -> str | None:
    """What an attempt of this run recorded under ``key`` (:func:`record_in_run`), or None."""
    memory = run_memory()
    if memory is None:
        return None
    try:
        with open(os.path.join(memory, key)) as fh:
            return fh.read()
    except OSError:
        return None


def record_in_run(key: str, value: str) -> None:
    """Record ``value`` under ``key`` for the later attempts of this run (nothing outside a launcher phalanx
    owns). Every rank may record the same value: each write replaces the file whole."""
    memory = run_memory()
    if memory is None:
        return
    with contextlib.suppress(OSError):
        os.makedirs(memory, exist_ok=True)
        tmp = os.path.join(memory, f".{key}.{os.getpid()}")
        with open(tmp, "w") as fh:
            fh.write(value)
        os.replace(tmp, os.path.join(memory, key))


def shown_path(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def show_tracebacks() -> bool:
    """Whether the user asked to see every rank's stderr (tracebacks included) on the terminal."""
    return os.environ.get(SHOW_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


# ------------------------------------------------------------------------------------------ the run
class RunLogs:
    """The log directory of one launch, and (as a context manager) the terminal view of it."""

    def __init__(self, run_id: str, *, show: bool | None = None, root: str | None = None, dst: TextIO | None = None,
                 ranks: int | None = None, first_rank: int = 0, environ: dict[str, str] | None = None,
                 max_restarts: int = 0):
        """``root``: the folder for run folders (default :func:`log_root`); ``ranks``: how many the job starts
        on this node (the ranks a failure summary names as stopped); ``first_rank``: the global rank of this
        node's local rank 0 (what labels its ranks' lines); ``dst``: where the ranks' output is shown (default:
        this process's stdout and stderr); ``environ``: variables the ranks get (set in this process while the
        job runs, as the agent copies its environment into the ranks'); ``max_restarts``: the agent's."""
        self.run_id = run_id
        self.show = show_tracebacks() if show is None else show
        self.dir = None if self.show else os.path.abspath(os.path.join(root or log_root(), run_id))
        self.ranks, self.max_restarts = ranks, max_restarts
        self._terminal = Terminal(dst, dst)
        self._first_rank = first_rank
        self._given = dict(environ or {})
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handler: logging.Handler | None = None
        self._recorder: AttemptRecorder | None = None
        self._saved: list[tuple[logging.Logger, bool]] = []
        self._tailed: dict[str, Tail] = {}
        self._environ: dict[str, str | None] = {}

    # -- what torch is told
    def logs_specs(self) -> Any:
        """``LaunchConfig(logs_specs=...)``: None (torch's default: all output on the terminal) when shown."""
        if self.dir is None:
            return None
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        return DefaultLogsSpecs(log_dir=self.dir, redirects=Std.ALL)

    def torchrun_args(self) -> list[str]:
        """The same, as ``torch.distributed.run`` arguments."""
        return [] if self.dir is None else ["--log-dir", self.dir, "--redirects", "3"]

    # -- while the job runs
    def __enter__(self) -> RunLogs:
        names = (RUN_VARIABLE, CAUSE_VARIABLE, _UNBUFFERED, *self._given)
        self._environ = {name: os.environ.get(name) for name in names}
        os.environ.pop(CAUSE_VARIABLE, None)
        os.environ.update(self._given)
        self._recorder = AttemptRecorder(self.error_file, self.ranks, self.max_restarts)
        logging.getLogger(_FAILURES_LOGGER).addHandler(self._recorder)
        if self.dir is None:
            return self
        os.environ[RUN_VARIABLE] = self.dir
        os.environ.setdefault(_UNBUFFERED, "1")
        os.makedirs(self.dir, exist_ok=True)
        handler = logging.FileHandler(os.path.join(self.dir, "launcher.log"), delay=True)  # created if used
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for name in _AGENT_LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.propagate))
            logger.addHandler(handler)
            logger.propagate = False
        self._handler = handler
        self._thread = threading.Thread(target=self._tail, name="phalanx-run-logs", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
        if kind is None and self.dir is not None and not self._hid_anything():
            # A job that ended well and whose output was all shown leaves nothing behind: the log would only
            # repeat the terminal. Otherwise (a failure, a traceback, an agent message) the log stays.
            shutil.rmtree(self.dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.dir))  # the log dir itself, when no other run is in it

    def _hid_anything(self) -> bool:
        launcher_log = os.path.join(str(self.dir), "launcher.log")
        return os.path.exists(launcher_log) or any(t.filter.hid for t in self._tailed.values() if t.filter is not None)

    def close(self) -> None:
        if self._recorder is not None:
            logging.getLogger(_FAILURES_LOGGER).removeHandler(self._recorder)
        for name, value in self._environ.items():  # this process may go on (launch(fn)): leave no trace
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._environ = {}
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._thread = None
        for logger, propagate in self._saved:
            if self._handler is not None:
                logger.removeHandler(self._handler)
            logger.propagate = propagate
        self._saved = []
        if self._handler is not None:
            self._handler.close()
            self._handler = None

    def rank_logs(self) -> dict[int, str]:
        """local rank -> its stderr file, for the (last) attempt of this run."""
        return self._rank_files("stderr.log")

    def error_files(self) -> list[str]:
        """The error files the ranks of the last attempt wrote (phalanx records a rank's failure or preemption
        there, see :func:`phalanx.distributed.launch.record_failure`)."""
        return list(self._rank_files("error.json").values())

    def _rank_files(self, name: str) -> dict[int, str]:
        if self.dir is None:
            return {}
        found: dict[int, str] = {}
        attempts = glob.glob(os.path.join(glob.escape(self.dir), "*", "attempt_*"))
        last = max(attempts, key=lambda a: int(a.rsplit("_", 1)[1]) if a.rsplit("_", 1)[1].isdigit() else -1,
                   default=None)
        for path in sorted(glob.glob(os.path.join(glob.escape(last), "*", name))) if last else []:
            rank = os.path.basename(os.path.dirname(path))
            if rank.isdigit():
                found[int(rank)] = path
        return found

    def error_file(self, attempt: int, rank: int) -> str:
        """Where the rank ``rank`` of attempt ``attempt`` writes its error ('' when nothing is redirected)."""
        if self.dir is None:
            return ""
        found = glob.glob(os.path.join(glob.escape(self.dir), "*", f"attempt_{attempt}"))
        return os.path.join(found[0], str(rank), "error.json") if found else ""

    @property
    def oom(self) -> int | None:
        """The kernel's out-of-memory kills counted during the attempt that failed last (None: unknown)."""
        return self._recorder.oom if self._recorder is not None else None

    def shown(self) -> str:
        """The run's log folder as the terminal shows it."""
        return shown_path(str(self.dir))

    def _tail(self) -> None:
        tailed = self._tailed
        while True:
            final = self._stop.is_set()
            for name in ("stdout.log", "stderr.log"):
                for rank, path in self._rank_files(name).items():
                    if path not in tailed:
                        label = rank_label(self._first_rank + rank)
                        tailed[path] = Tail(path, stderr=name == "stderr.log", label=label)
            # What each file got since the last poll, as of one moment, shown in the order the files last changed.
            for tail in tailed.values():
                tail.mark()
            pumped = [(tail.changed, i, tail, pieces) for i, tail in enumerate(tailed.values())
                      if (pieces := tail.pump(final))]
            for _, _, tail, pieces in sorted(pumped, key=lambda item: (item[0], item[1])):
                self._terminal.show(tail, tail.label, tail.stderr, pieces)
            if final:
                self._terminal.end()
                return
            self._stop.wait(_POLL_SECONDS)

    # -- after it failed
    def report_failure(self, err: Any, see_above: str = _SEE_ABOVE) -> int:
        """Print the end of a failed job (a ChildFailedError, or :class:`NotRestarted`, whose reason it adds):
        where its log is, then the cause (the last line). Returns the exit code."""
        if preempted_summary(err) is not None:  # not a failure: rank 0 already said it in one line
            return EXIT_PREEMPTED
        summary, code = failure_summary(err, self.ranks, self.oom)
        if isinstance(err, NotRestarted):
            summary += f". Not restarted: {err.why}"
        where = self.failed_logs(err)
        if where:
            note = f" {_SIGNAL_NOTE}" if "killed by" in summary else ""
            print(f"{where}{note}", file=sys.stderr)
            print(f"[phalanx] job failed: {summary}.", file=sys.stderr, flush=True)
        else:
            print(f"[phalanx] job failed: {summary}. {see_above}", file=sys.stderr, flush=True)
        return code

    def report_signal(self, signum: int) -> int:
        """The launcher received ``signum``; torch's agent passed it on to the ranks and waited for them. A rank
        that saved and stopped (a Trainer, or a loop asking ``fabric.stop_requested()``) recorded it, and rank 0
        said so in one line: exit code 75. Otherwise say here that nothing was saved, and exit as a process
        ended by that signal does (128 + its number), not as a preemption that can be resumed."""
        if any((recorded(Recorded.read(path)) or "").startswith("Preempted: ") for path in self.error_files()):
            return EXIT_PREEMPTED
        where = f" Logs: {self.shown()}" if self.dir is not None else ""
        print(f"[phalanx] The launcher received {signal_name(signum)} and passed it on to the ranks; no rank saved a "
              "checkpoint (a Fabric loop saves when fabric.stop_requested() says so)." + where,
              file=sys.stderr, flush=True)
        return 128 + signum

    def failed_logs(self, err: Any) -> str:
        """The line naming the run's log (the first-failed rank's stderr file first), or ''."""
        files = []
        for _, failure in causes(all_failures(err)):
            error_file = getattr(failure, "error_file", "") or ""
            path = os.path.join(os.path.dirname(error_file), "stderr.log") if error_file else ""
            if path and os.path.isfile(path):
                files.append(path)
        return self.where(files)

    def where(self, failed: list[str]) -> str:
        """One line naming the run's log directory and the failed ranks' stderr files (first-failed
        first), or '' when nothing was redirected."""
        if self.dir is None:
            return ""
        ranks = {path: os.path.basename(os.path.dirname(path)) for path in failed}
        named = "; ".join(f"rank {ranks[path]}: {shown_path(path)}" for path in failed)
        return (f"[phalanx] Tracebacks and stderr of every rank: {self.shown()}{f' ({named})' if named else ''}. "
                f"Set {SHOW_VARIABLE}=1 to print them here instead.")


__all__ = ["DEFAULT_DIR", "DIR_VARIABLE", "RUN_VARIABLE", "SHOW_VARIABLE", "RunLogs", "log_root",
           "show_tracebacks", "shown_path"]
