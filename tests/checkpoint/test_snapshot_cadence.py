"""When snapshots are taken (phalanx.checkpoint.snapshot.cadence): an int means exactly every N steps; "auto" takes
k = max(stall / (budget x step), copy / step) from what each snapshot cost, measured directly, leaves one-time
costs out, never lets the start cost more than the budget, settles within 50 steps and follows a change of the
step, and every rank takes the same steps. Driven by a simulated run (:class:`World`): a clock the cadence reads,
steps of a given length, and snapshots whose call, wait for the copy and copy take what the world says, reported
to the cadence as the writer reports them (a :class:`Cost`, final once the copy is complete)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from phalanx.checkpoint.snapshot import cadence as cadence_module
from phalanx.checkpoint.snapshot.cadence import PATIENCE, Cadence, Cost
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.late_reads import LateRead

MS = 1e-3
CLOCK = "phalanx.checkpoint.snapshot.cadence.time.perf_counter"  # what the cadence reads


def _alone(values: list[int]) -> LateRead:
    return LateRead(torch.tensor(values))


class World:
    """A run as the cadence sees it. Each step takes ``step(n)`` seconds; a snapshot's call takes ``call`` on the
    training thread, the optimizer step after it waits ``wait`` for its copy, and the copy is complete ``copy``
    after the call. A snapshot due while the previous copy is not complete waits for it in its call (the slot or
    the staging buffer is still being written). The first snapshot into each of the ``keep`` slots pays
    ``one_time_call`` more in its call and ``one_time_copy`` more in its copy (mapping, first touch). The slots are
    set up ``setup`` seconds after the first call (``ready``). The step after a snapshot loses ``indirect`` more,
    which no writer measures (another rank waiting for this one, the garbage collector)."""

    def __init__(self, step: Callable[[int], float], call: float, wait: float, copy: float, keep: int = 2,
                 one_time_call: float = 0.0, one_time_copy: float = 0.0, setup: float = 0.0,
                 indirect: float = 0.0) -> None:
        self.step, self.call, self.wait, self.copy, self.keep = step, call, wait, copy, keep
        self.indirect = indirect  # what the step after a snapshot loses beyond what the writer measures
        self.one_time_call, self.one_time_copy, self.setup = one_time_call, one_time_copy, setup
        self.now = 0.0
        self.clean = 0.0  # what the run would take without snapshots
        self.taken: list[int] = []
        self.lines: list[str] = []
        self.elapsed: dict[int, tuple[float, float]] = {}  # step -> (time, time without snapshots) after it
        self._copy_done = 0.0
        self._waiting: Cost | None = None
        self._inflight: list[tuple[float, Cost]] = []
        self._started: float | None = None

    def __call__(self) -> float:  # the cadence's time.perf_counter
        return self.now

    def ready(self, insist: bool) -> bool:
        return insist or self.now - (self._started or 0.0) >= self.setup

    def one_step(self, n: int, cadence: Any, agree: Callable[[list[int]], LateRead] = _alone) -> None:
        self.now += self.step(n)
        self.clean += self.step(n)
        if self._waiting is not None:  # the optimizer step waits for the last snapshot's copy
            self.now += self.wait + self.indirect
            self._waiting.host_wait = self.wait
            self._waiting = None
        for done, cost in list(self._inflight):  # the writer's poll: what has completed
            if done <= self.now:
                cost.final = True
                self._inflight.remove((done, cost))
        if self._started is None:
            self._started = self.now
        if cadence.due(n, agree, self.ready):
            start = self.now
            self.now = max(self.now, self._copy_done)
            first = len(self.taken) < self.keep
            self.now += self.call + (self.one_time_call if first else 0.0)
            cost = Cost(nbytes=1, call=self.now - start, one_time=first and bool(self.one_time_call or
                                                                                   self.one_time_copy))
            cost.copy = self.copy + (self.one_time_copy if first else 0.0)
            self._copy_done = self.now + cost.copy
            self._inflight.append((self._copy_done, cost))
            self._waiting = cost
            self.taken.append(n)
            line = cadence.taken(n, agree, cost)
            if line is not None:
                self.lines.append(line)
        self.elapsed[n] = (self.now, self.clean)

    def run(self, monkeypatch: pytest.MonkeyPatch, cadence: Any, steps: int) -> list[int]:
        monkeypatch.setattr(CLOCK, self)
        for n in range(1, steps + 1):
            self.one_step(n, cadence)
        return self.taken

    def overhead(self, n: int) -> float:
        """What snapshots cost the run up to step ``n``, as a share of the run without them."""
        spent, clean = self.elapsed[n]
        return spent / clean - 1


def _gaps(taken: list[int], after: int = 0, before: int = 10**9) -> list[int]:
    return [b - a for a, b in itertools.pairwise(taken) if after <= a and b <= before]


def _flat(ms: float) -> Callable[[int], float]:
    return lambda _: ms * MS


def test_an_int_means_exactly_every_n_steps() -> None:
    cadence = Cadence(3)
    due = [step for step in range(1, 13) if cadence.due(step) and cadence.taken(step) is None]
    assert due == [3, 6, 9, 12]
    assert cadence.every_n_steps == 3
    assert not cadence.due(12)  # the same step twice: once


@pytest.mark.parametrize(("step_ms", "call_ms", "wait_ms", "copy_ms", "expected"), [
    (10, 0.5, 1.5, 5, 4),  # the stall decides: 2 ms at 5 % of 10 ms steps -> every 4
    (10, 0.2, 0.4, 35, 4),  # the copy decides: 3.5 steps, though it stalls the loop 0.6 ms only
    (10, 1.0, 2.0, 45, 6),  # both near: 3 ms -> 6, 45 ms -> 5
    (10, 1.5, 0.0, 1, 3),  # the call alone is a stall: 1.5 ms -> every 3
    (5.5, 0.2, 0.05, 2, 1),  # nearly free: every step
])
def test_k_is_the_larger_of_the_stall_bound_and_the_copy_bound(
        monkeypatch: pytest.MonkeyPatch, step_ms: float, call_ms: float, wait_ms: float, copy_ms: float,
        expected: int) -> None:
    world = World(_flat(step_ms), call_ms * MS, wait_ms * MS, copy_ms * MS)
    cadence = Cadence("auto", max_overhead=0.05)
    taken = world.run(monkeypatch, cadence, 1500)
    stall = call_ms + wait_ms
    assert expected == max(1, math.ceil(stall / (0.05 * step_ms) - 1e-9), math.ceil(copy_ms / step_ms - 1e-9))
    assert cadence.every_n_steps == expected
    assert set(_gaps(taken, after=100)) == {expected}
    assert cadence.step_seconds == pytest.approx(step_ms * MS)
    assert cadence.stall_seconds == pytest.approx(stall * MS)
    assert cadence.copy_seconds == pytest.approx(copy_ms * MS)
    assert world.overhead(1500) <= 0.05 + 1e-9
    # Said once (no change since), with what it was decided on.
    steps = f"{expected} step{'s' if expected > 1 else ''}"
    limit = "the copy's time" if math.ceil(copy_ms / step_ms - 1e-9) >= expected > 1 else "the budget"
    assert world.lines == [f"snapshot every {steps}: {stall:.3g} ms of the loop's time each, {step_ms:.3g} ms per "
                           f"step, {stall / (expected * step_ms):.1%} of the run (budget 5%); copied in {copy_ms:.3g} "
                           f"ms; set by {limit}; a crash loses at most {steps}"]


def test_one_time_costs_are_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first snapshot into each slot maps it (40 ms on the training thread) and touches its pages (150 ms more
    # copy): not what the next ones cost. k = max(1 ms / 0.5 ms, 8 ms / 10 ms) = 2.
    world = World(_flat(10), 0.3 * MS, 0.7 * MS, 8 * MS, one_time_call=40 * MS, one_time_copy=150 * MS)
    cadence = Cadence("auto")
    taken = world.run(monkeypatch, cadence, 1000)
    assert cadence.stall_seconds == pytest.approx(1 * MS)
    assert cadence.copy_seconds == pytest.approx(8 * MS)
    assert set(_gaps(taken, after=500)) == {2}
    ends = [n - 1 for n in taken[1:]] + [1000]  # the one-time costs are paid back within the budget by each gap
    assert max(world.overhead(n) for n in ends) <= 0.05 + 1e-9


def test_the_start_costs_no_more_than_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each snapshot stalls the loop 6 ms and takes 60 ms (6 steps) to complete: k = max(12, 6) = 12. Until the
    # first one is measured nothing is known of it: the next one comes only once it is, as its cost allows.
    world = World(_flat(10), 1 * MS, 5 * MS, 60 * MS)
    cadence = Cadence("auto")
    taken = world.run(monkeypatch, cadence, 600)
    assert set(_gaps(taken)) == {12}
    ends = [n - 1 for n in taken[1:]] + [600]  # the run up to the end of each gap
    assert max(world.overhead(n) for n in ends) <= 0.05 + 1e-9
    assert max(world.overhead(n) for n in (50, 100, 200)) <= 0.05 + 1e-9


def test_k_settles_within_50_steps_and_follows_a_4x_longer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 ms of stall, 100 ms of copy: every 10 steps on 10 ms steps (the copy decides), every 3 once steps take 40 ms
    # (a larger batch; the copy still decides: 2.5 steps).
    world = World(lambda n: (10 if n <= 400 else 40) * MS, 0.5 * MS, 1.5 * MS, 100 * MS)
    cadence = Cadence("auto")
    taken = world.run(monkeypatch, cadence, 900)
    assert set(_gaps(taken, after=taken[0] + 50, before=400)) == {10}
    assert set(_gaps(taken, after=450)) == {3}
    assert world.overhead(400) <= 0.05 + 1e-9 and world.overhead(900) <= 0.05 + 1e-9


def test_on_a_host_what_the_snapshots_step_loses_beyond_the_call_and_waits_counts_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The call and the wait: 1 ms (every 2 steps at 5 % of 10 ms); the step that holds the snapshot takes 1 ms more
    # than that (the other rank waited for this one): 2 ms, every 4 steps.
    world = World(_flat(10), 0.5 * MS, 0.5 * MS, 2 * MS, indirect=1 * MS)
    cadence = Cadence("auto")
    taken = world.run(monkeypatch, cadence, 800)
    assert set(_gaps(taken, after=200)) == {4}
    assert cadence.stall_seconds == pytest.approx(2 * MS)
    assert world.overhead(800) <= 0.05 + 1e-9


def test_the_step_is_measured_without_the_snapshot_even_when_every_step_has_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The call and the host wait in a step are taken out of it: the step time follows a change though no step is
    # free of a snapshot.
    world = World(lambda n: (5 if n <= 300 else 10) * MS, 0.1 * MS, 0.1 * MS, 1 * MS)
    cadence = Cadence("auto")
    taken = world.run(monkeypatch, cadence, 600)
    assert set(_gaps(taken, after=50)) == {1}
    assert cadence.step_seconds == pytest.approx(10 * MS)


def test_every_rank_takes_the_same_steps_and_the_costliest_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two ranks, one with twice the stall, set up at different times: a snapshot counts only where both wrote it,
    # so both take the first one once both are set up and then follow the larger proposal, each read steps after
    # both ranks started the agreement.
    worlds = [World(_flat(10), 0.5 * MS, 1.5 * MS, 5 * MS, setup=30 * MS),
              World(_flat(10), 0.5 * MS, 3.5 * MS, 5 * MS, setup=120 * MS)]
    current = [worlds[0]]
    monkeypatch.setattr(CLOCK, lambda: current[0]())
    ranks = [Cadence("auto"), Cadence("auto")]
    started: dict[int, list[list[int]]] = {}

    class Agreement(LateRead):
        def __init__(self, index: int) -> None:
            super().__init__(torch.zeros(1))
            self.index = index

        def values(self) -> list[Any]:
            assert len(started[self.index]) == 2, "read before every rank proposed"
            return [max(column) for column in zip(*started[self.index])]

    counts = [0, 0]
    for step in range(1, 1500):
        for rank in (0, 1):
            current[0] = worlds[rank]

            def agree(values: list[int], rank: int = rank) -> LateRead:
                counts[rank] += 1
                started.setdefault(counts[rank], []).append(values)
                return Agreement(counts[rank])

            worlds[rank].one_step(step, ranks[rank], agree)
    assert worlds[0].taken == worlds[1].taken
    assert worlds[0].taken[0] > 12  # once rank 1 was set up (120 ms)
    assert ranks[0].every_n_steps == ranks[1].every_n_steps == 8  # 4 ms / (5 % of 10 ms)


def test_a_setup_starved_in_the_background_is_finished_on_the_training_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The slots never get set up in the background (every core busy): after PATIENCE points of waiting, every rank
    # finishes its own on the training thread, and snapshots start.
    world = World(_flat(10), 0.5 * MS, 0.5 * MS, 5 * MS, setup=float("inf"))
    cadence = Cadence("auto")
    taken = world.run(monkeypatch, cadence, 200)
    assert taken and taken[0] == cadence_module.WARMUP + 1 + (PATIENCE + 1) * cadence_module.PROBE
    assert cadence.every_n_steps == 2


def test_bad_settings_say_what_to_give() -> None:
    with pytest.raises(MisconfigurationError, match=r"every_n_steps=0: give an int >= 1 or 'auto'"):
        Cadence(0)
    with pytest.raises(MisconfigurationError, match=r"every_n_steps='often': give an int >= 1 or 'auto'"):
        Cadence("often")
    with pytest.raises(MisconfigurationError, match=r"max_overhead=5: give a share of the run in \(0, 1\)"):
        Cadence("auto", max_overhead=5)


def test_the_cadence_is_said_once_per_run_and_again_on_a_4x_change(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Any) -> None:
    """announcement(said, agreed): the first choice of a run is said, then only a change by 4x or more, whatever
    the attempt: a restarted attempt starts from what the run's earlier attempt said (its log folder's record)."""
    from phalanx.checkpoint.snapshot.cadence import announcement
    from phalanx.distributed.runlogs import RUN_VARIABLE

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv(RUN_VARIABLE, str(tmp_path))  # under a launcher phalanx owns
    assert announcement(None, 8) == (8, True)  # the first attempt's first choice
    assert announcement(8, 16) == (8, False) and announcement(8, 3) == (8, False)  # less than 4x: not again
    assert announcement(8, 32) == (32, True) and announcement(32, 8) == (8, True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restarted attempt measures anew
    assert announcement(None, 16) == (8, False)  # the run said 8 last
    assert announcement(None, 2) == (2, True)
    monkeypatch.delenv(RUN_VARIABLE)  # a plain torchrun restart: what was said is unknown; the first attempt said one
    assert announcement(None, 16) == (16, False)
    assert announcement(16, 4) == (4, True)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert announcement(None, 16) == (16, True)  # one process, no launcher
