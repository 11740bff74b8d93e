"""Exceptions phalanx raises. Each one says what went wrong and how to fix it."""

from __future__ import annotations

import contextlib
from typing import ClassVar


class PhalanxError(RuntimeError):
    """Base class of every error phalanx raises on purpose."""

    #: Why restarting the job's processes cannot fix this error (None: a restart may). The launchers phalanx
    #: owns do not restart a job that failed with such an error, and say why in their last line.
    unfixed_by_restart: ClassVar[str | None] = None


class MisconfigurationError(PhalanxError, ValueError):
    """A bad argument or an inconsistent combination of arguments."""

    unfixed_by_restart = "a configuration error fails the same way on every attempt"


class CollectiveError(PhalanxError):
    """Ranks fell out of step: a collective was called by a subset of ranks, or ranks called
    different collectives, or a rank died while the others waited for it."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within its bound."""


class CollectiveMismatchError(CollectiveError):
    """Ranks entered different collectives (or the same one from different call sites in strict mode)."""


class RankGoneError(CollectiveError):
    """A rank exited or stopped responding while the others waited for it."""


class GradientSyncError(PhalanxError):
    """Gradients (or parameters) differ across ranks where they must be identical."""


class CheckpointError(PhalanxError):
    """A checkpoint could not be written, read or matched to the objects it is loaded into."""

    unfixed_by_restart = "a checkpoint that cannot be used fails the same way on every attempt"


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes no longer match the checksums recorded when it was saved: using an earlier
    checkpoint is the fix, not changing the code that loads it."""


class PhalanxWarning(UserWarning):
    """Every warning phalanx issues (filter them all with this category)."""


_STEP = "phalanx_step"  # the attribute note_step sets on an exception


def note_step(error: BaseException, step: int) -> None:
    """Remember that ``error`` was raised at training step ``step``: a launcher that sees the next attempt
    fail with the same error at the same step does not restart it again."""
    with contextlib.suppress(AttributeError, TypeError):  # an exception type that takes no attributes
        setattr(error, _STEP, step)


def noted_step(error: BaseException) -> int | None:
    """The step :func:`note_step` recorded on ``error`` or on an exception it was raised from."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        step = getattr(current, _STEP, None)
        if isinstance(step, int):
            return step
        current = current.__cause__ or current.__context__
    return None
