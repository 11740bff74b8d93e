"""Profilers for ``Trainer(profiler="simple" | "advanced" | "pytorch" | Profiler)``.

Every profiler measures: the Trainer brackets each hook, step and backward with ``profiler.profile(name)``; the
report goes to ``dirpath/filename`` (one file per rank) or, without a dirpath, to the ``phalanx``
logger on rank 0 when the stage ends.

* ``SimpleProfiler``: wall time per action (count, mean, total, share of the run).
* ``AdvancedProfiler``: ``cProfile`` statistics per action.
* ``PyTorchProfiler``: ``torch.profiler`` (operator-level CPU/CUDA time); the Chrome trace is
  exported when ``dirpath`` is set.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from phalanx.utils import diagnostics
from phalanx.utils.errors import MisconfigurationError


class Profiler:
    """Base class: ``start(action)`` / ``stop(action)`` around what is measured, ``summary()`` to report."""

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None) -> None:
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename
        self._stage: str | None = None
        self._rank = 0

    def start(self, action_name: str) -> None: ...

    def stop(self, action_name: str) -> None: ...

    def summary(self) -> str:
        return ""

    @contextlib.contextmanager
    def profile(self, action_name: str) -> Iterator[None]:
        self.start(action_name)
        try:
            yield
        finally:
            self.stop(action_name)

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | Path | None = None) -> None:
        self._stage = stage
        self._rank = local_rank or 0
        if self.dirpath is None and log_dir is not None and self.filename is not None:
            self.dirpath = Path(log_dir)

    def describe(self) -> None:
        """Write the report: to ``dirpath/[stage-]filename[-rank].txt``, or to the log on rank 0."""
        text = self.summary()
        if not text:
            return
        if self.dirpath is not None:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            name = "-".join(p for p in (self._stage, self.filename or "profile") if p)
            (self.dirpath / f"{name}-rank{self._rank}.txt").write_text(text)
        else:
            diagnostics.info(f"Profiler report ({self._stage}):\n{text}", rank=self._rank)

    def teardown(self, stage: str | None) -> None: ...


class PassThroughProfiler(Profiler):
    """Measures nothing (the default)."""

    _nothing = contextlib.nullcontext()

    def profile(self, action_name: str) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        # The Trainer brackets every hook and step with profile(): without a profiler that must cost
        # nothing (no generator-based context per call), so one reusable no-op context serves them all.
        return self._nothing


class SimpleProfiler(Profiler):
    """Wall time of every action: calls, mean and total seconds, share of the profiled run."""

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None,
                 extended: bool = True) -> None:
        super().__init__(dirpath, filename)
        self.extended = extended
        self.recorded: dict[str, list[float]] = defaultdict(list)
        self._started: dict[str, float] = {}
        self._origin = time.monotonic()

    def start(self, action_name: str) -> None:
        if action_name in self._started:
            raise MisconfigurationError(f"Profiler action {action_name!r} was started twice without a stop.")
        self._started[action_name] = time.monotonic()

    def stop(self, action_name: str) -> None:
        begin = self._started.pop(action_name, None)
        if begin is None:
            raise MisconfigurationError(f"Profiler action {action_name!r} was stopped but never started.")
        self.recorded[action_name].append(time.monotonic() - begin)

    def summary(self) -> str:
        if not self.recorded:
            return ""
        total_run = max(time.monotonic() - self._origin, 1e-12)
        rows = sorted(((name, len(d), sum(d)) for name, d in self.recorded.items()), key=lambda r: -r[2])
        width = max(len("Action"), *(len(r[0]) for r in rows))
        lines = [f"{'Action':<{width}} | {'calls':>7} | {'mean s':>10} | {'total s':>10} | {'% of run':>8}"]
        lines.append("-" * len(lines[0]))
        for name, calls, total in rows:
            lines.append(f"{name:<{width}} | {calls:>7} | {total / calls:>10.6f} | {total:>10.4f} | "
                         f"{100 * total / total_run:>8.2f}")
        return "\n".join(lines)

    def teardown(self, stage: str | None) -> None:
        self._started.clear()


class AdvancedProfiler(Profiler):
    """``cProfile`` per action; the report lists each action's functions by cumulative time."""

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None,
                 line_count_restriction: float = 1.0, dump_stats: bool = False) -> None:
        super().__init__(dirpath, filename)
        if dump_stats and dirpath is None:
            raise MisconfigurationError("AdvancedProfiler(dump_stats=True) needs dirpath= for the .prof files.")
        self.line_count_restriction = line_count_restriction
        self.dump_stats = dump_stats
        self.profiled: dict[str, cProfile.Profile] = {}

    def start(self, action_name: str) -> None:
        self.profiled.setdefault(action_name, cProfile.Profile()).enable()

    def stop(self, action_name: str) -> None:
        prof = self.profiled.get(action_name)
        if prof is None:
            raise MisconfigurationError(f"Profiler action {action_name!r} was stopped but never started.")
        prof.disable()

    def summary(self) -> str:
        parts = []
        for name, prof in self.profiled.items():
            if self.dump_stats and self.dirpath is not None:
                self.dirpath.mkdir(parents=True, exist_ok=True)
                safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
                prof.dump_stats(str(self.dirpath / f"{self._stage}-{safe}-rank{self._rank}.prof"))
            out = io.StringIO()
            pstats.Stats(prof, stream=out).strip_dirs().sort_stats("cumulative").print_stats(
                self.line_count_restriction)
            parts.append(f"Profile stats for: {name}\n{out.getvalue()}")
        return "\n".join(parts)

    def teardown(self, stage: str | None) -> None:
        for prof in self.profiled.values():
            prof.disable()


class PyTorchProfiler(Profiler):
    """``torch.profiler.profile`` over the whole stage, with each action as a ``record_function`` range.

    Args:
        export_to_chrome: write ``<dirpath>/<stage>-<filename>-rank<r>.pt.trace.json`` (needs dirpath).
        row_limit / sort_by_key: the operator table in the report.
        profiler_kwargs: passed to ``torch.profiler.profile`` (e.g. ``record_shapes=True``).
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None,
                 export_to_chrome: bool = True, row_limit: int = 20, sort_by_key: str | None = None,
                 **profiler_kwargs: Any) -> None:
        super().__init__(dirpath, filename)
        self.export_to_chrome = export_to_chrome
        self.row_limit = row_limit
        self.sort_by_key = sort_by_key
        self.profiler_kwargs = profiler_kwargs
        self._profiler: Any = None
        self._ranges: dict[str, Any] = {}
        self._table = ""

    def _ensure_started(self) -> None:
        if self._profiler is None:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            kwargs = {"activities": activities, **self.profiler_kwargs}
            self._profiler = torch.profiler.profile(**kwargs)
            self._profiler.__enter__()

    def start(self, action_name: str) -> None:
        import torch

        self._ensure_started()
        rf = torch.autograd.profiler.record_function(action_name)
        rf.__enter__()
        self._ranges.setdefault(action_name, []).append(rf)

    def stop(self, action_name: str) -> None:
        stack = self._ranges.get(action_name)
        if not stack:
            raise MisconfigurationError(f"Profiler action {action_name!r} was stopped but never started.")
        stack.pop().__exit__(None, None, None)

    def _finish(self) -> None:
        if self._profiler is None:
            return
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        import torch

        key = self.sort_by_key or ("cuda_time_total" if torch.cuda.is_available() else "cpu_time_total")
        self._table = prof.key_averages().table(sort_by=key, row_limit=self.row_limit)
        if self.export_to_chrome and self.dirpath is not None:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            name = "-".join(p for p in (self._stage, self.filename or "profile") if p)
            prof.export_chrome_trace(str(self.dirpath / f"{name}-rank{self._rank}.pt.trace.json"))

    def summary(self) -> str:
        self._finish()
        return self._table

    def teardown(self, stage: str | None) -> None:
        self._finish()


_NAMED = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler,
          "passthrough": PassThroughProfiler}


def resolve_profiler(value: Any) -> Profiler:
    """``Trainer(profiler=...)``: None, a name, or a Profiler instance."""
    if value is None:
        return PassThroughProfiler()
    if isinstance(value, Profiler):
        return value
    if isinstance(value, str) and value.lower() in _NAMED:
        profiler: Profiler = _NAMED[value.lower()]()
        return profiler
    raise MisconfigurationError(
        f"profiler={value!r}; use one of {sorted(_NAMED)} or a phalanx.profilers.Profiler instance."
    )


__all__ = ["AdvancedProfiler", "PassThroughProfiler", "Profiler", "PyTorchProfiler", "SimpleProfiler",
           "resolve_profiler"]
