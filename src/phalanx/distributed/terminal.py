"""How the ranks' output reaches the launcher's terminal: whole lines, each rank's its own.

Under the launchers phalanx owns, torch's elastic agent writes each rank's stdout and stderr to files
(:mod:`phalanx.distributed.runlogs`); one thread of the launcher reads them as they grow (:class:`Tail`) and
shows them (:class:`Terminal`):

* a rank's lines stay whole: two ranks never share a line, and rank 0's lines read as on one process while
  every other rank's carry ``[rankN]: `` in front (torch's own prefix for a rank's traceback lines);
* a line another source left unfinished (a progress bar, redrawn in place with ``\\r``) is ended before the
  next source's line, so nothing is glued to a bar; a bar its own rank cleared (tqdm clears it before a
  ``tqdm.write``) is not ended, so no blank line appears;
* stdout pieces go to the launcher's stdout, stderr pieces to its stderr, in the order the ranks wrote them
  as far as the files tell (the pieces of one poll by the time their file last changed);
* of stderr, traceback blocks are left out (:class:`TracebackFilter`): the log file has them, and the
  launcher's summary quotes each cause once.
"""

from __future__ import annotations

import codecs
import os
import re
import sys
from dataclasses import dataclass
from typing import TextIO

#: One shown piece of a stream: its text (with its terminator, if it has one) and whether it starts a line (or
#: overwrites one from its start, after a ``\r``) rather than continue the piece shown before it.
Piece = tuple[str, bool]

PREFIX = re.compile(r"^\[rank\d+\]: ?")  # torch's excepthook prefixes each traceback line with the rank
_STARTS = ("Traceback (most recent call last):", "Exception in thread ", "Exception ignored in")
_WATCHDOG = re.compile(r"^\[phalanx\] rank \d+( is ending: |'s main thread was blocked here:)")
_CHAINED = ("The above exception was the direct cause", "During handling of the above exception")


def rank_label(rank: int) -> str:
    """What goes in front of each line of ``rank``: nothing for rank 0, whose lines read as on one process."""
    return "" if rank == 0 else f"[rank{rank}]: "


# ------------------------------------------------------------------------------------------ the filter
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
        stripped = PREFIX.sub("", line, count=1)
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


# ------------------------------------------------------------------------------------------ one stream
class Tail:
    """One stream of one rank, a file torch's agent writes (``stdout.log``, or ``stderr.log`` when ``stderr``):
    what of it has been read, the label of its lines (:func:`rank_label`) and, for stderr, its
    :class:`TracebackFilter`."""

    def __init__(self, path: str, *, stderr: bool, label: str = "") -> None:
        self.path, self.stderr, self.label = path, stderr, label
        self.offset = 0
        self.end: int | None = None  # how far to read at the next pump (None: to the end of the file)
        self.changed = 0  # when the file last changed (ns), as of :meth:`mark`
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.buffer = ""
        self.shown = 0  # how much of the unterminated line in ``buffer`` was already shown
        self.pending = ""  # ``buffer`` at the previous poll
        self.filter = TracebackFilter() if stderr else None

    def _show(self, piece: str) -> str:
        return self.filter.feed(piece) if self.filter is not None else piece

    def mark(self) -> None:
        """Note the file's length and time now: the next :meth:`pump` reads up to there. Marking every stream
        first, then reading, takes one moment's view of them all (reading one by one, a rank writes on
        meanwhile), so pieces can be put in the order their files changed."""
        try:
            st = os.stat(self.path)
        except OSError:
            self.end = None
            return
        self.end, self.changed = st.st_size, st.st_mtime_ns

    def pump(self, final: bool) -> list[Piece]:
        """What to show of what was written since the last call (up to :meth:`mark`'s point unless ``final``):
        each line whole (``\\n``, or ``\\r`` for a progress bar's redraw). ``final``: the writer is done, show
        what is left."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read() if final or self.end is None else fh.read(max(0, self.end - self.offset))
        except OSError:
            data = b""
        self.offset += len(data)
        self.buffer += self.decoder.decode(data, final=final)
        out: list[Piece] = []
        start = 0
        for match in re.finditer(r"\r\n|\n|\r", self.buffer):
            piece = self.buffer[start:match.end()]
            start = match.end()
            shown = self._show(piece)
            if shown[self.shown:]:
                out.append((shown[self.shown:], self.shown == 0))
            self.shown = 0
        self.buffer = self.buffer[start:]
        partial = self.buffer[self.shown:]
        if partial:
            # An unterminated line (a progress bar redrawn with "\r", a prompt) is shown once it stopped growing
            # for a poll, unless it may start a traceback; the rest of its line follows when it ends.
            if final:
                rest = self._show(self.buffer)[self.shown:]
                if rest:
                    out.append((rest, self.shown == 0))
                self.shown = len(self.buffer)
            elif self.buffer == self.pending and not (self.filter is not None and self.filter.may_hide(self.buffer)):
                out.append((partial, self.shown == 0))
                self.shown = len(self.buffer)
        self.pending = self.buffer
        return out


# ------------------------------------------------------------------------------------------ the terminal
@dataclass
class _Open:
    """A line a source left unfinished on one destination."""

    source: object
    at_start: bool  # its last piece ended with "\r": the cursor is back at the line's start
    blank: bool  # nothing visible on it: not written yet, or cleared with spaces (tqdm before tqdm.write)


def _same_place(a: TextIO, b: TextIO) -> bool:
    """Whether two streams end in the same place (a terminal, or ``2>&1``): then a line one of them left
    unfinished is the other's business too."""
    if a is b:
        return True
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


class Terminal:
    """Shows pieces of several sources (one rank's stdout or stderr each) on ``out`` and ``err`` (None: this
    process's ``sys.stdout`` and ``sys.stderr`` at the time), each source's lines whole and labelled."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self._out, self._err = out, err
        self._open: dict[int, _Open] = {}  # id of the destination (both, when they are one place) -> its open line

    def _streams(self) -> tuple[TextIO, TextIO]:
        return self._out or sys.stdout, self._err or sys.stderr

    def show(self, source: object, label: str, stderr: bool, pieces: list[Piece]) -> None:
        """Write ``pieces`` of ``source`` (its stderr when ``stderr``), with ``label`` in front of each line."""
        out, err = self._streams()
        dst = err if stderr else out
        key = id(err) if stderr or _same_place(out, err) else id(out)
        for text, fresh in pieces:
            line = self._open.get(key)
            if line is not None and line.source is not source:
                if not (line.at_start and line.blank):
                    self._write(dst, "\n")  # end the other source's bar or partial line: never glue to it
                line = None
                self._open.pop(key)
            fresh = fresh or line is None  # a continuation of a line that was ended meanwhile starts a new one
            content = text.rstrip("\r\n")
            self._write(dst, label + text if fresh and label and content and not PREFIX.match(content) else text)
            if text.endswith("\n"):
                self._open.pop(key, None)
                continue
            blank = line.blank if line is not None else True
            if content:
                blank = not content.strip() if fresh else blank and not content.strip()
            self._open[key] = _Open(source, text.endswith("\r"), blank)

    def end(self) -> None:
        """End every line left unfinished, so that what the launcher prints next starts a line of its own."""
        out, err = self._streams()
        for key, line in list(self._open.items()):
            if not (line.at_start and line.blank):
                self._write(err if key == id(err) else out, "\n")
        self._open.clear()

    @staticmethod
    def _write(dst: TextIO, text: str) -> None:
        try:
            dst.write(text)
            dst.flush()
        except (OSError, ValueError):
            pass


__all__ = ["PREFIX", "Piece", "Tail", "Terminal", "TracebackFilter", "rank_label"]
