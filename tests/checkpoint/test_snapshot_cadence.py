"""When snapshots are taken (phalanx.checkpoint.snapshot.cadence): an int means exactly every N steps; "auto"
measures the step and the snapshot and keeps their cost within the budget, re-measures when the run changes, and
every rank takes the same steps. Driven with a simulated clock: each step costs the step time, and the step after a
snapshot what the snapshot adds."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from phalanx.checkpoint.snapshot import cadence as cadence_module
from phalanx.checkpoint.snapshot.cadence import PROBE_EVERY, Cadence
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.late_reads import LateRead


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _alone(proposal: int) -> LateRead:
    return LateRead(torch.tensor([proposal]))


def _run(monkeypatch: pytest.MonkeyPatch, cadence: Cadence, steps: int, step_s: Any, snapshot_s: float,
         lines: list[str] | None = None) -> list[int]:
    """Drive ``cadence`` for ``steps`` steps; ``step_s(step)`` is a step's time. Returns the steps snapshotted."""
    clock = Clock()
    monkeypatch.setattr(cadence_module.time, "perf_counter", clock)
    taken = []
    for step in range(1, steps + 1):
        clock.now += step_s(step)
        if cadence.due(step):
            taken.append(step)
            clock.now += snapshot_s  # the call and what the copy adds to the next step
            line = cadence.taken(step, _alone)
            if line is not None and lines is not None:
                lines.append(line)
    return taken


def _gaps(taken: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(taken)]


def test_an_int_means_exactly_every_n_steps() -> None:
    cadence = Cadence(3)
    due = [step for step in range(1, 13) if cadence.due(step) and cadence.taken(step, _alone) is None]
    assert due == [3, 6, 9, 12]
    assert cadence.every_n_steps == 3
    assert not cadence.due(12)  # the same step twice: once


@pytest.mark.parametrize(("step_ms", "snapshot_ms", "expected"), [(10, 2, 4), (10, 100, 200), (5.5, 0.25, 1)])
def test_auto_keeps_the_cost_within_the_budget(monkeypatch: pytest.MonkeyPatch, step_ms: float, snapshot_ms: float,
                                               expected: int) -> None:
    # k = ceil(cost / (budget x step)): 2 ms on 10 ms steps at 5 % -> every 4 steps; 100 ms -> every 200.
    lines: list[str] = []
    cadence = Cadence("auto", max_overhead=0.05)
    taken = _run(monkeypatch, cadence, 3000, lambda _: step_ms / 1e3, snapshot_ms / 1e3, lines)
    assert cadence.every_n_steps == expected
    steady = [g for g in _gaps(taken)[6:] if g != max(expected, cadence_module.EFFECT + 2)] or _gaps(taken)[6:]
    assert set(steady) == {expected}
    assert cadence.step_seconds == pytest.approx(step_ms / 1e3)
    assert cadence.snapshot_seconds == pytest.approx(snapshot_ms / 1e3)
    late = [s for s in taken if s > 200]
    overhead = len(late) * snapshot_ms / ((3000 - 200) * step_ms)
    assert overhead <= 0.05
    # Said once (no change since), with what it was decided on.
    assert lines == [f"snapshot every {expected} step{'s' if expected > 1 else ''}: {snapshot_ms:.3g} ms each, "
                     f"{step_ms:.3g} ms per step, {snapshot_ms / (expected * step_ms):.1%} of the run (budget 5%); "
                     f"a crash loses at most {expected} step{'s' if expected > 1 else ''}"]


def test_auto_measures_again_when_the_run_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Steps become 4x longer at step 1000 (another phase): the same snapshot is then cheaper in relative terms.
    lines: list[str] = []
    cadence = Cadence("auto")
    taken = _run(monkeypatch, cadence, 2500, lambda step: 0.010 if step < 1000 else 0.040, 0.004, lines)
    before = [g for s, g in zip(taken, _gaps(taken)) if 300 < s < 1000 and g != cadence_module.EFFECT + 2]
    after = [g for g in _gaps([s for s in taken if s > 1500]) if g != cadence_module.EFFECT + 2]
    assert set(before) == {8} and set(after) == {2}
    assert [line.split(":")[0] for line in lines] == ["snapshot every 8 steps", "snapshot every 2 steps"]


def test_every_rank_takes_the_same_steps_and_the_costliest_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two ranks, one with twice the snapshot cost: a snapshot counts only where both wrote it, so both follow
    # the larger proposal, read one snapshot later from the agreement both started.
    clocks = [Clock(), Clock()]
    current: list[Clock] = [clocks[0]]
    monkeypatch.setattr(cadence_module.time, "perf_counter", lambda: current[0]())
    ranks = [Cadence("auto"), Cadence("auto")]
    proposals: dict[int, list[int]] = {}

    class Agreement(LateRead):
        def __init__(self, index: int) -> None:
            super().__init__(torch.zeros(1))
            self.index = index

        def values(self) -> list[Any]:
            assert len(proposals[self.index]) == 2, "read before every rank proposed"
            return [max(proposals[self.index])]

    taken: list[list[int]] = [[], []]
    costs = [0.002, 0.004]
    for step in range(1, 1500):
        for rank in (0, 1):
            current[0] = clocks[rank]
            clocks[rank].now += 0.010
            if ranks[rank].due(step):
                taken[rank].append(step)
                clocks[rank].now += costs[rank]
                index = len(taken[rank])

                def agree(proposal: int, index: int = index) -> LateRead:
                    proposals.setdefault(index, []).append(proposal)
                    return Agreement(index)

                ranks[rank].taken(step, agree)
    assert taken[0] == taken[1]
    assert ranks[0].every_n_steps == ranks[1].every_n_steps == 8  # 4 ms / (5 % of 10 ms)


def test_bad_settings_say_what_to_give() -> None:
    with pytest.raises(MisconfigurationError, match=r"every_n_steps=0: give an int >= 1 or 'auto'"):
        Cadence(0)
    with pytest.raises(MisconfigurationError, match=r"every_n_steps='often': give an int >= 1 or 'auto'"):
        Cadence("often")
    with pytest.raises(MisconfigurationError, match=r"max_overhead=5: give a share of the run in \(0, 1\)"):
        Cadence("auto", max_overhead=5)


def test_probes_keep_the_step_time_fresh_when_snapshots_are_nearly_free(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every PROBE_EVERY-th gap is long enough to see steps no snapshot touched, so a change of the step time is
    # not taken for the snapshot's cost for long.
    cadence = Cadence("auto")
    taken = _run(monkeypatch, cadence, 900, lambda step: 0.010 if step < 300 else 0.020, 0.0)
    assert cadence.every_n_steps == 1
    assert cadence.step_seconds == pytest.approx(0.020)
    assert set(_gaps([s for s in taken if s > 600])) == {1, cadence_module.EFFECT + 2}
    assert sum(g == cadence_module.EFFECT + 2 for g in _gaps([s for s in taken if s > 600])) <= 300 // PROBE_EVERY + 1


def test_a_snapshot_costs_at_least_its_own_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # Noise can make the steps after a snapshot look no longer than the others: the call's own time, paid on the
    # training thread, is still a cost (0.5 ms on 10 ms steps at 5 %: every step, not "free").
    clock = Clock()
    monkeypatch.setattr(cadence_module.time, "perf_counter", clock)
    cadence = Cadence("auto")
    for step in range(1, 400):
        clock.now += 0.010
        if cadence.due(step):
            cadence.taken(step, _alone, seconds=0.0015)
    assert cadence.snapshot_seconds == pytest.approx(0.0015)
    assert cadence.every_n_steps == 3


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
