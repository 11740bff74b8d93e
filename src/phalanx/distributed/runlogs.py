"""Where the output of a job phalanx launches goes, so that a failure reads once, at the end.

Under the launchers phalanx owns (``fabric.launch()`` and ``fabric.launch(fn)`` under ``python train.py``,
the Trainer with ``devices=N``, ``phalanx run``):

* the run's log folder is ``<root>/phalanx_logs/<run id>``: the root is the Trainer's ``default_root_dir``,
  a Fabric's first logger's ``root_dir`` (else the working directory), and the working directory under
  ``phalanx run`` (it starts before the script says anything); ``$PHALANX_LOG_DIR`` replaces
  ``<root>/phalanx_logs``. The ranks learn it (``PHALANX_RUN_LOGS``) so that their fault lines name it;
* each rank's **stderr** is written to a file by torch's elastic agent itself
  (``DefaultLogsSpecs(redirects=Std.ERR)``, torchrun's ``--redirects 2 --log-dir``):
  ``<run folder>/<torch run id>_<x>/attempt_<n>/<local rank>/stderr.log``. Nothing is lost: the file has all
  of it, tracebacks included;
* each rank's **stdout** is left alone: training prints reach the terminal live, as before;
* a thread shows the stderr files on the terminal as they grow (progress bars, warnings, phalanx's
  notices), leaving out traceback blocks (:class:`TracebackFilter`);
* torch's agent logs (about a failed rank, its traceback for ``launch(fn)``, "Sending process ... closing
  signal", "Received 15 death signal") go to ``<run folder>/launcher.log`` instead of the terminal;
* a failed attempt's summary is recorded for the restarted ranks
  (:class:`phalanx.distributed.failures.AttemptRecorder`);
* at the end the launcher prints where the log is and the cause (:mod:`phalanx.distributed.failures`).

``PHALANX_SHOW_TRACEBACKS=1`` (``phalanx run --show-tracebacks``) turns the redirection off: every rank
prints to the terminal as torch's launcher does by default. Under a plain ``torchrun`` phalanx changes
nothing.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import logging
import os
import re
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

SHOW_VARIABLE = "PHALANX_SHOW_TRACEBACKS"
DIR_VARIABLE = "PHALANX_LOG_DIR"
DEFAULT_DIR = "phalanx_logs"
#: Set by the launcher for its ranks: the run's log folder, which their fault lines name.
RUN_VARIABLE = "PHALANX_RUN_LOGS"

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


def shown_path(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def show_tracebacks() -> bool:
    """Whether the user asked to see every rank's stderr (tracebacks included) on the terminal."""
    return os.environ.get(SHOW_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


# ------------------------------------------------------------------------------------------ the filter
_PREFIX = re.compile(r"^\[rank\d+\]: ?")  # torch's excepthook prefixes each traceback line with the rank
_STARTS = ("Traceback (most recent call last):", "Exception in thread ", "Exception ignored in")
_WATCHDOG = re.compile(r"^\[phalanx\] rank \d+( is ending: |'s main thread was blocked here:)")
_CHAINED = ("The above exception was the direct cause", "During handling of the above exception")


class TracebackFilter:
    """Decides, line by line, what of a rank's stderr is shown on the terminal: everything except
    traceback blocks (``Traceback ...`` through the exception line, chained ones included) and the
    watchdog's report of a rank it ends (the launcher's summary quotes both causes). Stateful: feed one
    rank's lines in order."""

    def __init__(self) -> None:
        self.state = "show"  # "show" | "traceback" (inside the frames) | "after" (the exception line was seen)
        self.prefixed = False
        self.hid = False  # whether any line was left out (then the log holds more than the terminal showed)

    @staticmethod
    def _core(line: str) -> tuple[str, bool]:
        stripped = _PREFIX.sub("", line, count=1)
        return stripped, stripped != line

    def _starts(self, core: str) -> bool:
        return (core.startswith(_STARTS) or bool(_WATCHDOG.match(core))
                or core.lstrip(" +").startswith("Exception Group Traceback"))

    def feed(self, piece: str) -> str:
        """One line with its terminator (``\\n``, or ``\\r`` for a progress bar's update); returns what to
        show ('' to hide it)."""
        shown = self._feed(piece)
        self.hid = self.hid or (not shown and bool(piece.strip()))
        return shown

    def _feed(self, piece: str) -> str:
        text = piece.rstrip("\r\n")
        core, prefixed = self._core(text)
        if self.state == "show":
            if piece.endswith("\n") and self._starts(core):
                self.state, self.prefixed = "traceback", prefixed
                return ""
            return piece
        if self.state == "after":
            # After the exception line: its further message lines (torch prefixes them too), blank lines
            # and a chained traceback still belong to the block; anything else is output again.
            if (self.prefixed and prefixed) or not text.strip() or core.startswith(_CHAINED):
                return ""
            self.state = "show"
            return self._feed(piece)
        # Inside the frames: indented lines, blank lines, chaining notes, the watchdog's stack.
        if not text.strip() or text[:1] in " \t" or core[:1] in " \t" or core.startswith(_CHAINED) \
                or self._starts(core):
            return ""
        self.state = "after"  # the exception line ("ValueError: ..."), hidden too
        return ""

    def may_hide(self, partial: str) -> bool:
        """Whether an unterminated line could turn out to be hidden (then it waits for its end)."""
        if self.state != "show":
            return True
        if partial.startswith("[") and "]" not in partial:
            return True  # perhaps the start of "[rankN]: Traceback" or "[phalanx] rank N is ending"
        core = self._core(partial)[0].lstrip(" +")
        return any(c.startswith(core) or core.startswith(c) for c in (*_STARTS, "[phalanx] rank ", "Exception Group"))


class _Tailed:
    """One rank's stderr file: what of it has been read, and its filter."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.buffer = ""
        self.shown = 0  # how much of the unterminated line in ``buffer`` was already shown
        self.pending = ""  # ``buffer`` at the previous poll
        self.filter = TracebackFilter()

    def pump(self, final: bool) -> str:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            data = b""
        self.offset += len(data)
        self.buffer += self.decoder.decode(data, final=final)
        out = []
        start = 0
        for match in re.finditer(r"\r\n|\n|\r", self.buffer):
            piece = self.buffer[start:match.end()]
            start = match.end()
            shown = self.filter.feed(piece)
            out.append(shown[self.shown:] if shown else "")
            self.shown = 0
        self.buffer = self.buffer[start:]
        partial = self.buffer[self.shown:]
        if partial:
            # An unterminated line (a progress bar redrawn with "\r") is shown once it stopped growing for a
            # poll, unless it may start a traceback; the rest of its line follows when it ends.
            if final:
                out.append(self.filter.feed(self.buffer)[self.shown:])
                self.shown = len(self.buffer)
            elif self.buffer == self.pending and not self.filter.may_hide(self.buffer):
                out.append(partial)
                self.shown = len(self.buffer)
        self.pending = self.buffer
        return "".join(out)


# ------------------------------------------------------------------------------------------ the run
class RunLogs:
    """The log directory of one launch, and (as a context manager) the terminal view of it."""

    def __init__(self, run_id: str, *, show: bool | None = None, root: str | None = None, dst: TextIO | None = None,
                 ranks: int | None = None, max_restarts: int = 0):
        """``root``: the folder for run folders (default :func:`log_root`); ``ranks``: how many the job starts
        on this node (the ranks a failure summary names as stopped); ``max_restarts``: the agent's."""
        self.run_id = run_id
        self.show = show_tracebacks() if show is None else show
        self.dir = None if self.show else os.path.abspath(os.path.join(root or log_root(), run_id))
        self.ranks, self.max_restarts = ranks, max_restarts
        self._dst = dst
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handler: logging.Handler | None = None
        self._recorder: AttemptRecorder | None = None
        self._saved: list[tuple[logging.Logger, bool]] = []
        self._tailed: dict[str, _Tailed] = {}
        self._environ: dict[str, str | None] = {}

    # -- what torch is told
    def logs_specs(self) -> Any:
        """``LaunchConfig(logs_specs=...)``: None (torch's default: all output on the terminal) when shown."""
        if self.dir is None:
            return None
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        return DefaultLogsSpecs(log_dir=self.dir, redirects=Std.ERR)

    def torchrun_args(self) -> list[str]:
        """The same, as ``torch.distributed.run`` arguments."""
        return [] if self.dir is None else ["--log-dir", self.dir, "--redirects", "2"]

    # -- while the job runs
    def __enter__(self) -> RunLogs:
        self._environ = {name: os.environ.get(name) for name in (RUN_VARIABLE, CAUSE_VARIABLE)}
        os.environ.pop(CAUSE_VARIABLE, None)
        self._recorder = AttemptRecorder(self.error_file, self.ranks, self.max_restarts)
        logging.getLogger(_FAILURES_LOGGER).addHandler(self._recorder)
        if self.dir is None:
            return self
        os.environ[RUN_VARIABLE] = self.dir
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
        return os.path.exists(launcher_log) or any(t.filter.hid for t in self._tailed.values())

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
            for path in self.rank_logs().values():
                tailed.setdefault(path, _Tailed(path))
            text = "".join(t.pump(final) for t in tailed.values())
            if text:
                dst = self._dst or sys.stderr
                try:
                    dst.write(text)
                    dst.flush()
                except (OSError, ValueError):
                    pass
            if final:
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


__all__ = ["DEFAULT_DIR", "DIR_VARIABLE", "RUN_VARIABLE", "SHOW_VARIABLE", "RunLogs", "TracebackFilter", "log_root",
           "show_tracebacks", "shown_path"]
