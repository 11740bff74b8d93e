"""``AccumulationSchedule``: how many batches each epoch accumulates before an optimizer step.

The Trainer's settings are frozen, so a per-epoch change (Lightning's ``GradientAccumulationScheduler``)
is not a write to a Trainer attribute: it is this schedule, which the training loop reads at the start
of each epoch. ``Trainer(accumulate_grad_batches=N)`` is the constant schedule ``{0: N}``. It sits below
the callbacks and the Trainer because the callback builds one and the Trainer reads it.
"""

from __future__ import annotations

from collections.abc import Mapping

from phalanx.utils.errors import MisconfigurationError


class AccumulationSchedule:
    """Epoch -> batches per optimizer step; an epoch uses the entry of the largest key at or below it."""

    __slots__ = ("_entries",)

    def __init__(self, scheduling: int | Mapping[int, int]) -> None:
        entries = {0: scheduling} if isinstance(scheduling, int) else dict(scheduling)
        if not entries or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in entries) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in entries.values()):
            raise MisconfigurationError(
                f"accumulation schedule {scheduling!r}: keys are epochs >= 0, values ints >= 1."
            )
        entries.setdefault(0, 1)
        self._entries: tuple[tuple[int, int], ...] = tuple(sorted(entries.items(), reverse=True))

    def at(self, epoch: int) -> int:
        """The accumulation of ``epoch``."""
        return next(n for start, n in self._entries if start <= epoch)

    @property
    def scheduling(self) -> dict[int, int]:
        """The schedule as ``{first epoch: batches}``, in epoch order."""
        return dict(reversed(self._entries))

    @property
    def constant(self) -> bool:
        """Every epoch accumulates the same number of batches."""
        return len({n for _, n in self._entries}) == 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AccumulationSchedule) and other.scheduling == self.scheduling

    def __hash__(self) -> int:
        return hash(self._entries)

    def __repr__(self) -> str:
        return f"AccumulationSchedule({self.scheduling})"
