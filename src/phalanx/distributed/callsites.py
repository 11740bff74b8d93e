"""Where code is: the call site a rank reports, where a foreign thread is blocked, and where an exception
was raised. Separate from the watchdog because the lockstep guard needs the same answers on the main
thread (the call site of each guarded collective, the user frame of a raw ``torch.distributed`` call
that failed) and the watchdog on its own thread (where the main thread is stuck).

"Internal" frames are phalanx's own (the whole package, not only this folder), the standard library's
and, by default, torch's: a report names the user's line that led there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from types import FrameType, TracebackType

import torch

# The phalanx package (this file is phalanx/distributed/callsites.py): frames anywhere in it are internal.
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_C10D_FILE = os.path.join(_TORCH_DIR, "distributed", "distributed_c10d.py")
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))


def _is_internal(fname: str, skip_torch: bool = True) -> bool:
    return (
        fname.startswith(_PKG_DIR)
        or (skip_torch and fname.startswith(_TORCH_DIR))
        or (fname.startswith(_STDLIB_DIR) and "site-packages" not in fname)
        or fname.startswith("<")
    )


def _site(frame: FrameType | None, skip_torch: bool = True) -> str:
    while frame is not None:
        if not _is_internal(frame.f_code.co_filename, skip_torch):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "<unknown>"


def user_call_site(skip_torch: bool = True) -> str:
    """``file:line (function)`` of the innermost frame outside phalanx (and torch)."""
    return _site(sys._getframe(1), skip_torch)


def describe_frame_stack(frame: FrameType | None) -> tuple[str, str]:
    """Where a (foreign) thread is: its innermost user frame, and the torch.distributed function it is
    blocked in ('' if none)."""
    c10d = ""
    probe = frame
    while probe is not None:
        if probe.f_code.co_filename == _C10D_FILE:
            c10d = probe.f_code.co_name
        probe = probe.f_back
    return _site(frame), c10d


def describe_exception(exc: BaseException) -> str:
    """``Type: message (raised at file:line (fn), called from user.py:12 (main))`` on one line."""
    text = " ".join(str(exc).split())[:500]
    tb: TracebackType | None = exc.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    where = ""
    if frames:
        inner = frames[-1]
        raised = f"{os.path.basename(inner.f_code.co_filename)}:{inner.f_lineno} ({inner.f_code.co_name})"
        user = next((f for f in reversed(frames) if not _is_internal(f.f_code.co_filename)), None)
        called = ""
        if user is not None and user is not inner:
            line = next(t.tb_lineno for t in _tb_chain(exc) if t.tb_frame is user)
            called = f", called from {os.path.basename(user.f_code.co_filename)}:{line} ({user.f_code.co_name})"
        where = f" (raised at {raised}{called})"
    return f"{type(exc).__name__}: {text}{where}"


def raw_collective(exc: BaseException) -> tuple[str, str] | None:
    """``(torch.distributed function, user call site)`` when ``exc`` was raised inside a raw
    ``torch.distributed`` call (one phalanx did not issue), else None."""
    frames = [t.tb_frame for t in _tb_chain(exc)]
    c10d = next((f.f_code.co_name for f in frames if f.f_code.co_filename == _C10D_FILE), None)
    if c10d is None or any(f.f_code.co_filename.startswith(_PKG_DIR) for f in frames):
        return None
    user = next((t for t in reversed(list(_tb_chain(exc))) if not _is_internal(t.tb_frame.f_code.co_filename)), None)
    site = "<unknown>" if user is None else (
        f"{os.path.basename(user.tb_frame.f_code.co_filename)}:{user.tb_lineno} ({user.tb_frame.f_code.co_name})")
    return c10d, site


def _tb_chain(exc: BaseException) -> Iterable[TracebackType]:
    tb = exc.__traceback__
    while tb is not None:
        yield tb
        tb = tb.tb_next


__all__ = ["describe_exception", "describe_frame_stack", "raw_collective", "user_call_site"]
