"""How often to snapshot: every N steps, or as often as a budget allows (``"auto"``, the default).

A snapshot copies the whole training state (16 bytes per parameter under Adam with fp32 weights) while a
step computes about 6 x tokens FLOPs per parameter: how often one fits depends on the model, the batch and
the machine, not on a number the user should have to find. With ``"auto"`` two limits decide, as in
CheckFreq (Mohan et al., FAST '21), each measured directly for every snapshot by the writer (:class:`Cost`):

* the **stall**, what the training loop loses: the call, plus the optimizer step's wait for the copy of the
  tensors it is about to change (on a CPU the pieces the training thread copies itself; on a GPU the stream
  wait, and of the call what the device idled through, both timed by CUDA events), plus what the background
  copy took at normal priority from the cores the training competes for (its thread's CPU clock). At most
  ``max_overhead`` of the run: k >= stall / (max_overhead x step);
* the **copy**, from the call until the snapshot is complete (the copy's event on a GPU). A snapshot starts
  only after the previous one is complete: k >= copy / step.

k is the smallest int that meets both. The step is the median time between calls that held no snapshot
(while every step holds one: less the call and the host waits in it). Stall and copy are the medians of the
last :data:`RECENT` snapshots. On a host the stall is also at least what the step that held the snapshot took
beyond the latest steps without one (its own step, not the neighbours'): the other ranks waiting for the
slowest call, the garbage its objects leave to the collector, cost the loop too. (On a GPU the host's steps do
not show the device's time: the events do.) One-time costs (mapping a slot, registering it with CUDA,
touching its pages) stay out of both: the writer sets the slots up in the background before the first
snapshot (:meth:`due`'s ``ready``), and a snapshot that paid such a cost itself says so
(:attr:`Cost.one_time`).

The start. The first snapshot is taken once every rank's slots are set up. The gap after it follows from
what it cost (one-time costs included, should it have paid any), so the start never costs more than the
budget; from then on k follows the medians, so it settles within a few snapshots and follows a change of
the step (a larger batch) within about twenty steps plus two gaps.

The ranks. Every rank must snapshot the same steps (a snapshot counts once every rank has written it), so
every decision rests on values the ranks agreed on: each *point* (a snapshot, or a step where the cadence
waits for every rank) starts a max-reduction of this rank's proposal, read at a later point at least
:data:`LAG` steps on, where it is long complete (the read never waits for the device). Which agreements a
point reads depends on step numbers only, so every rank reads the same.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.distributed.runlogs import record_in_run, run_memory, said_in_run
from phalanx.utils.diagnostics import restarted
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.late_reads import LateRead

#: Calls before the first point: the first steps of a run are slower than the rest (allocations, caches).
WARMUP = 5
#: Steps between points while the cadence waits for every rank (its setup, the first snapshot's measurement).
PROBE = 2
#: Steps between starting an agreement and reading it (as the preemption agreement does).
LAG = 2
#: Points spent waiting for a rank's setup before every rank finishes its own on the training thread (a
#: background thread that gets no CPU, every core busy, must not keep snapshots off for good).
PATIENCE = 8
#: Step times kept (the median: a logger flush or a validation pass does not decide).
STEPS = 32
#: Snapshots whose stall and copy are kept (the median).
RECENT = 7
#: Steps without a snapshot that a step holding one is compared with (the latest: a change of the step is
#: not taken for the snapshot's cost; while every step holds one, none is, and the call and waits decide).
NEAR = 5
#: Measured snapshots before the choice is said.
SETTLED = 3
#: The gap before any agreement has set one.
FIRST_GAP = 4
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

#: Starts a max-reduction of this rank's values across the ranks (``strategy.max_across_ranks_late``).
Agree = Callable[[list[int]], LateRead]
#: Whether this rank is set up to snapshot; True: finish setting up on this thread first.
Ready = Callable[[bool], bool]


@dataclass(eq=False)
class Cost:
    """What one snapshot cost, measured directly; the writer fills it in as each part becomes known (a device's
    parts from CUDA events, once they have completed) and sets :attr:`final` last."""

    nbytes: int = 0
    #: Seconds of the training thread in the snapshot call.
    call: float = 0.0
    #: On a device, what the call cost it: the seconds it idled meanwhile (two events around the call; while the
    #: host is ahead of the device, time spent in the call costs nothing). None on a host.
    call_on_device: float | None = None
    #: Seconds the training thread waited for the copy after the call (the optimizer's pre-step hook).
    host_wait: float = 0.0
    #: Seconds the device's training stream waited for the copy (the optimizer step's stream wait).
    device_wait: float = 0.0
    #: CPU seconds the background thread spent on the copy at normal priority (while the training waited for
    #: it, or where it may not enter the idle class): taken from the cores the training competes for.
    cpu: float = 0.0
    #: Seconds from the call until the snapshot was complete (on a GPU: the copy on the side stream).
    copy: float = 0.0
    #: The snapshot paid a one-time cost (it mapped or registered a slot, allocated pinned memory).
    one_time: bool = False
    #: Copied by a device (its costs are in device time, from events; the host's step times do not show them).
    device: bool = False
    #: It does not count (torn, or a copy failed).
    failed: bool = False
    final: bool = False

    @property
    def stall(self) -> float:
        """What the training loop lost to this snapshot."""
        call = self.call if self.call_on_device is None else self.call_on_device
        return call + self.host_wait + self.device_wait + self.cpu


_SETUP, _MEASURE, _STEADY = "setup", "measure", "steady"


class Cadence:
    """When to snapshot. ``every_n_steps``: an int (exactly every that many steps: ``step % n == 0``) or
    ``"auto"``; ``max_overhead``: the share of the run snapshots may cost under ``"auto"``.

    Call :meth:`due` once per step, on every rank; after each snapshot call :meth:`taken` with what it cost
    (on every rank: it starts a collective through ``agree``)."""

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
        #: Bytes of tensors in the last snapshot.
        self.snapshot_bytes = 0
        self._phase = _SETUP
        self._last: tuple[int, float] | None = None  # (step, time) of the previous call
        self._next: int | None = None  # the step of the next point ("auto")
        self._taken = -1  # the step of the last snapshot
        self._latest: Cost | None = None  # what the last snapshot cost
        self._inside: Cost | None = None  # the snapshot taken since the previous call
        self._pending: list[Cost] = []  # taken, not measured yet
        self._steps: deque[tuple[float, bool]] = deque(maxlen=STEPS)  # (seconds, held no snapshot)
        self._stalls: deque[float] = deque(maxlen=RECENT)
        self._excess: deque[float] = deque(maxlen=RECENT)  # what a host step holding a snapshot took beyond a step
        self._copies: deque[float] = deque(maxlen=RECENT)
        self._agreements: deque[tuple[int, LateRead]] = deque()  # (step started, agreement), oldest first
        self._agreed: list[int] | None = None  # the newest agreement read
        self._waited = 0  # points spent waiting for setup
        self._measured = 0  # snapshots measured
        self._basis: tuple[float, float, float] | None = None  # (stall, copy, step) of this rank's last proposal
        self._announced: int | None = None

    # ------------------------------------------------------------------ measurements
    @property
    def step_seconds(self) -> float | None:
        """The time of a step without its snapshot (median of recent steps), or None before any."""
        clean = [seconds for seconds, free in self._steps if free]
        if len(clean) * 4 < len(self._steps):  # (nearly) every step holds a snapshot: those, less its own time
            clean = [seconds for seconds, _ in self._steps]
        return statistics.median(clean) if clean else None

    @property
    def stall_seconds(self) -> float | None:
        """What one snapshot costs the training loop (median of recent ones), or None before any was measured."""
        if not self._stalls:
            return None
        stall = statistics.median(self._stalls)
        return max(stall, statistics.median(self._excess)) if self._excess else stall

    @property
    def copy_seconds(self) -> float | None:
        """How long a snapshot takes to be complete (median of recent ones), or None before any was measured."""
        return statistics.median(self._copies) if self._copies else None

    def _observe(self, step: int) -> None:
        now = time.perf_counter()
        last, inside, self._inside = self._last, self._inside, None
        self._last = (step, now)
        if last is None or step <= last[0]:
            return
        spent, steps = now - last[1], step - last[0]
        if inside is None:
            self._steps.append((spent / steps, True))
            return
        near = [seconds for seconds, free in self._steps if free][-NEAR:]  # the step as it is now
        if len(near) >= 3 and not (inside.device or inside.one_time or inside.failed):
            self._excess.append(max(0.0, spent - steps * statistics.median(near)))
        # Less the call and what the optimizer step waited for the copy on this thread.
        self._steps.append((max(spent - inside.call - inside.host_wait, 0.0) / steps, False))

    def _collect(self) -> None:
        for cost in [c for c in self._pending if c.final]:
            self._pending.remove(cost)
            if not (cost.one_time or cost.failed):
                self._stalls.append(cost.stall)
                self._copies.append(cost.copy)
                self._measured += 1

    def _bound(self, stall: float, copy: float) -> int:
        """The smallest k that keeps ``stall`` within the budget and lets a ``copy`` finish before the next one."""
        step = self.step_seconds
        assert step is not None and step > 0
        by_stall = math.ceil(stall / (self.max_overhead * step) - 1e-6)  # 8.0000001 is 8
        by_copy = math.ceil(copy / step - 1e-6)
        return min(_MAX_GAP, max(1, by_stall, by_copy))

    def _proposal(self) -> int:
        """This rank's k from its measurements (0: nothing to go on yet)."""
        step = self.step_seconds
        if step is None or step <= 0:
            return 0
        stall, copy = self.stall_seconds, self.copy_seconds
        if stall is None or copy is None:
            latest = self._latest  # nothing measured in steady conditions yet: what the last one cost, all of it
            if latest is None or not latest.final:
                return 0
            stall, copy = max(latest.stall, self._excess[-1] if self._excess else 0.0), latest.copy
        self._basis = (stall, copy, step)
        return self._bound(stall, copy)

    # ------------------------------------------------------------------ agreeing
    def _start(self, agree: Agree, step: int, values: list[int]) -> None:
        self._agreements.append((step, agree(values)))

    def _read(self, step: int) -> list[int] | None:
        """The newest agreement started at least :data:`LAG` steps before ``step`` (None if none is new)."""
        fresh = None
        while self._agreements and self._agreements[0][0] <= step - LAG:
            fresh = [int(v) for v in self._agreements.popleft()[1].values()]
        if fresh is not None:
            self._agreed = fresh
        return fresh

    # ------------------------------------------------------------------ deciding
    def due(self, step: int, agree: Agree | None = None, ready: Ready | None = None) -> bool:
        """Whether to snapshot at ``step`` (the same answer on every rank). ``agree``: how to start an agreement
        across the ranks; ``ready``: whether this rank's slots are set up (under ``"auto"``)."""
        self._observe(step)
        self._collect()
        if not self.auto:
            assert self.every_n_steps is not None
            return step % self.every_n_steps == 0 and step != self._taken
        if self._next is None:
            self._next = step + WARMUP
        if step < self._next or step == self._taken:
            return False
        if self._phase == _STEADY:
            return True  # a step every rank agreed on
        assert agree is not None, "an 'auto' cadence agrees across ranks: pass agree"
        agreed = self._read(step)
        if self._phase == _SETUP:  # the first snapshot, once every rank has its slots set up
            if agreed is not None and agreed[1] == 0:
                return True
            mine = ready(self._waited >= PATIENCE) if ready is not None else True
            self._waited += 1
            self._start(agree, step, [0, 0 if mine else 1])
            self._next = step + PROBE
            return False
        # The gap after the first snapshot follows from what it cost, once every rank has measured it.
        if agreed is not None and agreed[1] == 0:
            self._phase = _STEADY
            self.every_n_steps = agreed[0] or FIRST_GAP  # 0: no rank wrote one
            self._next = self._taken + self.every_n_steps
            return step >= self._next
        latest = self._latest
        measured = latest is None or latest.final
        self._start(agree, step, [self._proposal() if measured else 0, 0 if measured else 1])
        self._next = step + PROBE
        return False

    def taken(self, step: int, agree: Agree | None = None, cost: Cost | None = None) -> str | None:
        """After the snapshot of ``step`` (``cost``: what it cost, filled in later by the writer; None when this
        rank did not write it): set the next snapshot. Returns a line to announce (the chosen cadence, once its
        measurements have settled, and again when it changes by 4x or more), else None."""
        self._taken, self._latest, self._inside = step, cost, cost
        if cost is not None:
            self._pending.append(cost)
            self.snapshot_bytes = cost.nbytes
        if not self.auto:
            return None
        assert agree is not None, "an 'auto' cadence agrees across ranks: pass agree"
        if self._phase == _SETUP:
            self._phase = _MEASURE
            self.every_n_steps = self.every_n_steps or FIRST_GAP
            self._next = step + PROBE
            return None
        agreed = self._read(step)
        basis, self._basis = self._basis, None
        if agreed is not None and agreed[0] > 0:
            self.every_n_steps = agreed[0]
        self._start(agree, step, [self._proposal(), 0])
        assert self.every_n_steps is not None
        self._next = step + self.every_n_steps
        if agreed is None or agreed[0] <= 0 or basis is None or self._measured < SETTLED:
            return None
        self._announced, say = announcement(self._announced, self.every_n_steps)
        return self.describe(*basis) if say else None

    def describe(self, stall: float | None = None, copy: float | None = None, step: float | None = None) -> str:
        """The cadence in effect and why, in one line (``stall``, ``copy``, ``step``: the measurements it was
        chosen on; the current ones by default)."""
        k = self.every_n_steps
        step = step if step is not None else self.step_seconds
        stall = stall if stall is not None else self.stall_seconds
        copy = copy if copy is not None else self.copy_seconds
        if not self.auto or k is None or step is None or stall is None or copy is None:
            return f"snapshot every {k} steps"
        steps = f"{k} step{'s' if k != 1 else ''}"
        limit = "the copy's time" if math.ceil(copy / step - 1e-6) >= k > 1 else "the budget"
        return (f"snapshot every {steps}: {stall * 1e3:.3g} ms of the loop's time each, {step * 1e3:.3g} ms per step, "
                f"{stall / (k * step):.1%} of the run (budget {self.max_overhead:.0%}); copied in {copy * 1e3:.3g} "
                f"ms; set by {limit}; a crash loses at most {steps}")
