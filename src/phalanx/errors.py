"""Exceptions phalanx raises (defined in :mod:`phalanx.utils.errors`; this is their public name)."""

from phalanx.utils.errors import (
    CheckpointError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GradientSyncError,
    MisconfigurationError,
    PhalanxError,
    PhalanxWarning,
    RankGoneError,
)

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "GradientSyncError",
    "MisconfigurationError",
    "PhalanxError",
    "PhalanxWarning",
    "RankGoneError",
]
