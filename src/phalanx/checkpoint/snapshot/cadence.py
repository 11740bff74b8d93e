"""How often to snapshot: every N steps, or as often as a budget allows (``"auto"``, the default).

A snapshot copies the whole training state (16 bytes per parameter under Adam with fp32 weights) while a
step computes about 6 x tokens FLOPs per parameter: whether the copy fits in a step depends on the model,
the batch and the machine, not on a number the user should have to find. So with ``"auto"`` the cadence is
chosen the way CheckFreq (Mohan et al., FAST '21) chooses it: measure, online, the step time and what a
snapshot costs the run, and snapshot every k steps, k the smallest whose overhead stays within
``max_overhead``; measured again as the run goes, so a change of phase changes k.

Measured as wall time between the calls, which come once per step:

* the step time s: the median of recent steps no snapshot touched (more than :data:`EFFECT` steps after one);
* a snapshot's cost c: what the :data:`EFFECT` steps after it took beyond s (the call itself, the copy that
  overlaps them, the optimizer step that waits for it), at least the call's own time; the median of the last
  nine.

Then k = ceil(c / (max_overhead x s)). Every rank must snapshot the same steps (a snapshot counts once
every rank has written it), so the ranks agree on k: each snapshot starts a max-reduction of every rank's
proposal, read at the next snapshot, where the value is long there (the read never waits for the device);
the gap after that snapshot is the agreed k. Before any measurement the gap is :data:`FIRST_GAP`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

from phalanx.distributed.runlogs import record_in_run, run_memory, said_in_run
from phalanx.utils.diagnostics import restarted
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.late_reads import LateRead

#: Calls before the first snapshot: the first steps of a run are slower than the rest (allocations, caches).
WARMUP = 5
#: The gap between snapshots before the ranks have agreed on a measured one.
FIRST_GAP = 4
#: Steps after a snapshot that its copy may slow (a device copy is felt by the host a step or two late).
EFFECT = 3
#: Measured snapshots before the choice is said (the median of fewer is too easily an outlier).
SETTLED = 5
#: Snapshots whose cost is not measured: each of the first ones maps a new slot file (two are kept by default).
MAPPING = 2
#: Every this many snapshots, the gap after one is at least ``EFFECT + 2``, so the step time is measured
#: again even where snapshots are so cheap that they are taken every step or two.
PROBE_EVERY = 16
_MAX_GAP = 1_000_000
_SAID = "snapshot-cadence"  # what the run records of the cadence it said (announcement)


def announcement(said: int | None, agreed: int) -> tuple[int | None, bool]:
    """When the cadence is said: ``said`` is the gap this process said last (None: none yet), ``agreed`` the one
    just chosen from settled measurements. Returns the gap said last from now on, and whether to say ``agreed``
    now: the first choice of a run, then only a change by 4x or more. A run says it once, not once per attempt:
    a restarted attempt starts from what an earlier one said (recorded in the run's log folder under a launcher
    phalanx owns; elsewhere its first choice is taken as said, as the first attempt said one)."""
    if said is None:
        before = said_in_run(_SAID)
        if before is not None and before.isdigit():
            said = int(before)
        elif restarted() and run_memory() is None:
            return agreed, False
    if said is not None and max(agreed, said) < 4 * min(agreed, said):
        return said, False
    record_in_run(_SAID, str(agreed))
    return agreed, True


class Cadence:
    """When to snapshot. ``every_n_steps``: an int (exactly every that many steps: ``step % n == 0``) or
    ``"auto"``; ``max_overhead``: the share of the run snapshots may cost under ``"auto"``.

    Call :meth:`due` once per step, on every rank; after each snapshot call :meth:`taken` (on every rank:
    it starts a collective through ``agree``)."""

    def __init__(self, every_n_steps: int | str = "auto", max_overhead: float = 0.05) -> None:
        fixed = isinstance(every_n_steps, int) and not isinstance(every_n_steps, bool)
        if not (fixed and every_n_steps >= 1) and every_n_steps != "auto":  # type: ignore[operator]
            raise MisconfigurationError(f"every_n_steps={every_n_steps!r}: give an int >= 1 or 'auto'.")
        if not 0 < max_overhead < 1:
            raise MisconfigurationError(f"max_overhead={max_overhead!r}: give a share of the run in (0, 1), "
                                        "e.g. 0.05 for 5 %.")
        self.auto = not fixed
        self.max_overhead = max_overhead
        #: The gap in effect, in steps (under "auto": None until the first snapshot).
        self.every_n_steps: int | None = None if self.auto else int(every_n_steps)
        self._last: tuple[int, float] | None = None  # (step, time) of the previous call
        self._next: int | None = None  # the step of the next snapshot ("auto")
        self._taken = -1  # the step of the last snapshot
        self._clean: deque[float] = deque(maxlen=15)  # step times no snapshot touched
        self._costs: deque[float] = deque(maxlen=9)  # a median robust to the odd slow step (a log flush)
        self._window: list[float] = []  # step times since the last snapshot, within its effect
        self._window_size = 0
        self._count = 0  # snapshots taken
        self._call = 0.0  # what the call of the snapshot whose effect is being measured took: its cost at least
        self._agreement: LateRead | None = None
        self._basis: tuple[float, float] | None = None  # (cost, step) this rank's pending proposal was made on
        self._announced: int | None = None

    @property
    def step_seconds(self) -> float | None:
        """The measured time of a step no snapshot touched (median), or None before any."""
        return statistics.median(self._clean) if self._clean else None

    @property
    def snapshot_seconds(self) -> float | None:
        """What one snapshot costs the run (median of the last nine), or None before any was measured."""
        return statistics.median(self._costs) if self._costs else None

    def due(self, step: int) -> bool:
        """Whether to snapshot at ``step`` (the same answer on every rank)."""
        if not self.auto:
            assert self.every_n_steps is not None
            return step % self.every_n_steps == 0 and step != self._taken
        now = time.perf_counter()
        last = self._last
        if last is not None and step > last[0]:
            self._observe(step, (now - last[1]) / (step - last[0]))
        self._last = (step, now)
        if self._next is None:
            self._next = step + WARMUP
        return step >= self._next and step != self._taken

    def _observe(self, step: int, seconds: float) -> None:
        if self._taken < 0 or step - self._taken > EFFECT:
            self._clean.append(seconds)
            return
        if len(self._window) >= self._window_size:
            return
        self._window.append(seconds)
        base = self.step_seconds
        if len(self._window) == self._window_size and base is not None:
            self._costs.append(max(self._call, sum(self._window) - base * len(self._window)))

    def taken(self, step: int, agree: Callable[[int], LateRead], seconds: float = 0.0) -> str | None:
        """After the snapshot of ``step`` (its call took ``seconds``): start the agreement on this rank's proposal
        and set the next snapshot from the previous agreement. Returns a line to announce (the chosen cadence, once
        its measurements have settled, and again when it changes by 4x or more), else None."""
        self._taken = step
        self._count += 1
        if not self.auto:
            return None
        previous, self._agreement = self._agreement, None
        agreed = int(max(previous.values())) if previous is not None else 0
        basis, self._basis = self._basis, None
        self._agreement = agree(self._proposal())
        self._call = seconds
        gap = agreed if agreed > 0 else FIRST_GAP
        self.every_n_steps = gap
        if self._count % PROBE_EVERY == 0:
            gap = max(gap, EFFECT + 2)  # steps no snapshot touches, to measure the step again (every rank alike)
        self._next = step + gap
        # The first snapshots' costs include mapping their files (one per slot kept): not what the next ones cost.
        self._window, self._window_size = [], min(EFFECT, gap) if self._count > MAPPING else 0
        if agreed <= 0 or basis is None or len(self._costs) < SETTLED:
            return None
        self._announced, say = announcement(self._announced, agreed)
        return self.describe(*basis) if say else None

    def _proposal(self) -> int:
        """This rank's k (0: not measured yet)."""
        base, cost = self.step_seconds, self.snapshot_seconds
        if base is None or base <= 0 or cost is None:
            return 0
        self._basis = (cost, base)
        return min(_MAX_GAP, max(1, math.ceil(cost / (self.max_overhead * base) - 1e-6)))  # 8.0000001 is 8

    def describe(self, cost: float | None = None, base: float | None = None) -> str:
        """The cadence in effect and why, in one line (``cost`` and ``base``: the snapshot and step times it was
        chosen on; the current measurements by default)."""
        k = self.every_n_steps
        base = base if base is not None else self.step_seconds
        if not self.auto or k is None or base is None:
            return f"snapshot every {k} steps"
        cost = cost if cost is not None else self.snapshot_seconds or 0.0
        return (f"snapshot every {k} step{'s' if k != 1 else ''}: {cost * 1e3:.3g} ms each, {base * 1e3:.3g} ms per "
                f"step, {cost / (k * base):.1%} of the run (budget {self.max_overhead:.0%}); a crash loses at most "
                f"{k} step{'s' if k != 1 else ''}")
