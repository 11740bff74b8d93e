"""Counting the host reads of device values that phalanx's own code makes (issue: the accelerator never waits).

A read of a device value on the host (``tensor.item()``, ``float(tensor)``, ``bool``, ``int``, ``tolist``,
``numpy``, ``cpu``) makes the CPU wait until the device has computed it: on a GPU every queued kernel runs
out first and the device idles while the CPU queues the next step. On a CPU-only machine such reads cost
nothing, so they are invisible there; :class:`HostReads` makes them visible. It is a ``TorchFunctionMode``
that records each such call made directly by a file of phalanx's source (the frame that called the tensor
method, past torch's dispatch wrappers), with ``PHALANX_DEFER_HOST_READS=1`` set so that code which reads
CPU values at once but defers them on a GPU takes its GPU path. Not counted: reads made inside torch
(an optimizer's own bookkeeping, GradScaler, DeepSpeed's engine), and those of
:mod:`phalanx.utils.late_reads`, which reads host copies of values taken steps earlier (see there).
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import phalanx

SOURCE = str(Path(phalanx.__file__).resolve().parent) + "/"
_TORCH = Path(torch.__file__).resolve().parent
DISPATCH = {str(_TORCH / "overrides.py"), str(_TORCH / "_tensor.py"), __file__}  # how a method reaches the mode
LATE = str(Path(phalanx.__file__).resolve().parent / "utils" / "late_reads.py")
READS = {"item", "__float__", "__bool__", "__int__", "__index__", "tolist", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """Records ``file:line (method)`` for every host read phalanx's source makes while active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        self.active = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if self.active and name in READS:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename in DISPATCH:
                frame = frame.f_back  # type: ignore[assignment]
            file = frame.f_code.co_filename if frame is not None else ""
            if file.startswith(SOURCE) and file != LATE:
                self.reads[f"{file[len(SOURCE):]}:{frame.f_lineno} ({name})"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.reads.values())


class DeviceSyncs:
    """On a GPU, the real thing: the host-device synchronizations torch's sync debug mode reports while
    ``active`` (every one, torch's own included), ``file:line`` of the frame that made each."""

    def __init__(self) -> None:
        self.syncs: Counter[str] = Counter()
        self.active = False
        self._catch: Any = None
        self._records: list[Any] = []

    def __enter__(self) -> DeviceSyncs:
        torch.cuda.set_sync_debug_mode("warn")
        self._catch = warnings.catch_warnings(record=True)
        self._records = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def tick(self) -> None:
        """Count what was reported since the last tick (when active)."""
        for w in self._records:
            if self.active and "synchroniz" in str(w.message):
                self.syncs[f"{Path(w.filename).name}:{w.lineno}"] += 1
        self._records.clear()

    def __exit__(self, *exc: Any) -> None:
        self.tick()
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
