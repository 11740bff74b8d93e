"""Exceptions phalanx raises. Each one says what went wrong and how to fix it."""

from __future__ import annotations


class PhalanxError(RuntimeError):
    """Base class of every error phalanx raises on purpose."""


class MisconfigurationError(PhalanxError, ValueError):
    """A bad argument or an inconsistent combination of arguments."""


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


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes no longer match the checksums recorded when it was saved: using an earlier
    checkpoint is the fix, not changing the code that loads it."""


class PhalanxWarning(UserWarning):
    """Every warning phalanx issues (filter them all with this category)."""
